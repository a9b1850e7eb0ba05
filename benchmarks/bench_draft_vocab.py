"""Drafting cost with a draft vocabulary subset (FR-Spec style) vs the full vocabulary, on the default target.

The default target (SmolLM2-135M-Instruct, V = 49,152, hidden 576) and a fresh draft (`load_draft(target,
"fresh")`: one layer, Markov rank 64) run greedy speculative `generate()` with the fixed policy (every round
drafts and verifies a full block of γ = 7). For the full vocabulary and for subsets of K in `--ks` (the K
most frequent tokens of the assistant turns of ShareGPT conversations from the training slice, tokenized by
the target's tokenizer, always including EOS / end-of-turn), it reports per round:

* `drafting_ms`: the drafting step, `draft_time + sequential_time` of `last_generation_stats(draft).rounds`
  (context update, backbone, base logits, sequential + confidence heads, sampling loop);
* `round_ms`: drafting plus target verification (`verify_time`), and `wall_per_round_ms` (wall clock of the
  generate() calls divided by their rounds, prefill included);
* `lm_head_ms`: the draft's base-logit projection of γ positions alone (`draft.draft_logits`), timed
  separately;
* `coverage`: the share of the target's own greedy output tokens (in these runs) that lie in the subset,
  an upper bound on how often a trained draft could still propose the right token.

Configurations are interleaved within every repeat, so they see the same machine load; medians over repeats.
Outputs are checked to be identical across configurations (the subset is lossless). A fresh draft is used on
purpose: with τ ≈ 1 every round does the same work whatever the subset.

`--coverage-only` times nothing: it reports, for each K, the share of the tokens of *held-out* ShareGPT
assistant turns (conversations from `SHAREGPT_HELDOUT_START` on, never used to choose the subset) that lie in
the subset, a larger sample of the trade-off than the benchmark's own few outputs.

Usage:
    python benchmarks/bench_draft_vocab.py [--repeats 3] [--ks 4096 8192 16384] [--threads 1] [--note TEXT]
    python benchmarks/bench_draft_vocab.py --coverage-only [--out benchmarks/results/draft_vocab_coverage.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

import dspark_hf
from dspark_hf import last_generation_stats
from dspark_hf.default_model import chat_inputs, load_default_target, load_draft
from dspark_hf.model.vocab import frequent_token_ids

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a Python function that reverses a string.",
    "What is 17 times 23?",
]


def frequency_text(limit: int) -> tuple[list[str], str]:
    """Real text for token frequencies: assistant turns of ShareGPT (training slice), else this repo's docs."""
    try:
        from dspark_hf.evaluation.prompt_sets import SHAREGPT_HELDOUT_START, sharegpt_conversations

        conversations = sharegpt_conversations()[: min(limit, SHAREGPT_HELDOUT_START)]
        texts = [t["value"] for c in conversations for t in c if t.get("from") == "gpt" and t.get("value")]
        if texts:
            return texts, f"ShareGPT assistant turns, first {len(conversations)} conversations"
    except ImportError:
        pass
    docs = Path(__file__).resolve().parents[1] / "docs"
    return [p.read_text(encoding="utf-8") for p in sorted(docs.glob("*.md"))], "docs/*.md of this repository"


def heldout_coverage(tokenizer, subsets: dict) -> dict:
    """Share of held-out ShareGPT assistant-turn tokens inside each subset."""
    from dspark_hf.evaluation.prompt_sets import SHAREGPT_HELDOUT_START, sharegpt_conversations

    conversations = sharegpt_conversations()[SHAREGPT_HELDOUT_START:]
    texts = [t["value"] for c in conversations for t in c if t.get("from") == "gpt" and t.get("value")]
    tokens = torch.tensor([t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"]])
    out = {"heldout_conversations": len(conversations), "heldout_tokens": int(tokens.numel()), "coverage": {}}
    for name, ids in subsets.items():
        out["coverage"][name] = 1.0 if ids is None else float(torch.isin(tokens, ids).double().mean())
    return out


def always_ids(tokenizer) -> list[int]:
    """EOS and the chat template's end-of-turn token(s)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for token in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(ids)


def measure(target, draft, inputs, max_new_tokens: int) -> dict:
    """One pass over the prompts: per-round means (seconds) and the generated token ids."""
    drafting = verify = wall = 0.0
    rounds = 0
    outputs = []
    for ids in inputs:
        start = time.perf_counter()
        out = target.generate(
            **ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, dspark_policy="fixed"
        )
        wall += time.perf_counter() - start
        outputs.append(out[0, ids["input_ids"].shape[1] :].tolist())
        for r in last_generation_stats(draft).rounds:
            drafting += r.draft_time + r.sequential_time
            verify += r.verify_time
        rounds += last_generation_stats(draft).num_rounds
    return {
        "drafting": drafting / rounds,
        "round": (drafting + verify) / rounds,
        "wall_per_round": wall / rounds,
        "rounds": rounds,
        "outputs": outputs,
    }


def time_lm_head(draft, gamma: int, hidden_size: int, reps: int = 30) -> float:
    """Median seconds of `draft.draft_logits` over one block of γ positions."""
    hidden = torch.randn(1, gamma, hidden_size, dtype=draft.dtype)
    with torch.no_grad():
        draft.draft_logits(hidden)  # warm-up (and gathers the subset's rows once)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            draft.draft_logits(hidden)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--frequency-conversations", type=int, default=2000)
    parser.add_argument("--note", default="", help="free text stored in the JSON, e.g. the machine's load")
    parser.add_argument("--coverage-only", action="store_true", help="held-out coverage per K; no timing")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/draft_vocab[_coverage].json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.out is None:
        args.out = f"benchmarks/results/draft_vocab{'_coverage' if args.coverage_only else ''}.json"

    target, tokenizer = load_default_target()
    texts, source = frequency_text(args.frequency_conversations)
    token_seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    always = always_ids(tokenizer)
    subsets = {"full": None}
    for k in args.ks:
        subsets[f"K={k}"] = frequent_token_ids(token_seqs, k, always=always, vocab_size=target.config.vocab_size)
    if args.coverage_only:
        report = {"command": "python " + shlex.join(sys.argv), "frequency_source": source, "always_included": always}
        report.update(heldout_coverage(tokenizer, subsets))
        for name, cov in report["coverage"].items():
            print(f"{name:>8}: {100 * cov:.1f}% of {report['heldout_tokens']} held-out tokens")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
        return
    draft, _ = load_draft(target, "fresh")
    gamma = draft.config.block_size
    inputs = [chat_inputs(tokenizer, p) for p in PROMPTS]

    draft.set_draft_vocab(None)
    measure(target, draft, inputs[:1], 8)  # warm-up
    samples: dict[str, list[dict]] = {name: [] for name in subsets}
    lm_head: dict[str, list[float]] = {name: [] for name in subsets}
    for _ in range(args.repeats):
        for name, ids in subsets.items():  # interleaved: every configuration sees the same load
            draft.set_draft_vocab(ids)
            samples[name].append(measure(target, draft, inputs, args.max_new_tokens))
            lm_head[name].append(time_lm_head(draft, gamma, target.config.hidden_size))
    draft.set_draft_vocab(None)

    reference = samples["full"][0]["outputs"]
    generated = [t for out in reference for t in out]
    results = {}
    for name, ids in subsets.items():
        assert all(s["outputs"] == reference for s in samples[name]), f"{name}: output differs (must be lossless)"
        med = {k: statistics.median(s[k] for s in samples[name]) for k in ("drafting", "round", "wall_per_round")}
        row = {f"{k}_ms": 1000 * v for k, v in med.items()}
        row["lm_head_ms"] = 1000 * statistics.median(lm_head[name])
        # paired per repeat, then the median: robust to load drifting between repeats
        for key in ("drafting", "round"):
            row[f"{key}_vs_full"] = statistics.median(s[key] / f[key] for s, f in zip(samples[name], samples["full"]))
        row["rounds_per_pass"] = samples[name][0]["rounds"]
        if ids is not None:
            members = set(ids.tolist())
            row["K"] = len(members)
            row["coverage"] = sum(t in members for t in generated) / len(generated)
        else:
            row["K"] = target.config.vocab_size
            row["coverage"] = 1.0
        results[name] = row

    report = {
        "command": "python " + shlex.join(sys.argv),
        "note": args.note,
        "torch": torch.__version__,
        "dspark_hf": dspark_hf.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "repeats": args.repeats,
        "target": "HuggingFaceTB/SmolLM2-135M-Instruct (V = 49152, hidden 576)",
        "draft": f"fresh (load_draft(target, 'fresh'): 1 layer, Markov rank 64), greedy, fixed policy, gamma = {gamma}",
        "frequency_source": source,
        "always_included": always,
        "results": results,
    }
    print(f"\n== per-round medians over {args.repeats} repeats ({args.threads} thread(s)); {source}")
    print(
        f"{'config':>8} {'K':>6} {'lm head':>9} {'drafting':>9} {'round':>9} {'wall/rnd':>9} "
        f"{'draft vs full':>14} {'round vs full':>14} {'coverage':>9}"
    )
    for name, r in results.items():
        print(
            f"{name:>8} {r['K']:6d} {r['lm_head_ms']:8.1f}m {r['drafting_ms']:8.1f}m {r['round_ms']:8.1f}m "
            f"{r['wall_per_round_ms']:8.1f}m {r['drafting_vs_full']:14.3f} {r['round_vs_full']:14.3f} "
            f"{100 * r['coverage']:8.1f}%"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
