"""Evaluating drafts: the harness, prompt sets and task metrics."""
