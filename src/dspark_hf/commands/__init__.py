"""Subcommands of the `dspark` CLI; each module exposes `add_arguments(parser)` and `main(args)`."""
