"""Training cost of a DSpark draft for SmolLM2-135M-Instruct on this machine: time and memory per token.

Each configuration runs in its own process (so peak RSS is per configuration) and trains a few dozen steps
with `dspark_hf.train.train` (online mode unless stated), batch 1, on synthetic chat sequences: a chat
prompt followed by a response of random tokens, all of it supervised after the prompt. Cost does not
depend on the content, only on the sequence length `T` and the number of anchors `N` (slots `S = N·γ`).

Reported per configuration:

* `tok/s`: sequence tokens trained per second (median over steps after two warm-up steps);
* `ms/slot`: milliseconds per supervised block slot (the unit the draft's loss is computed on);
* `target ms`: the target's feature forward alone on one sequence (the part a feature cache saves);
* `peak RSS`: the process's peak resident memory, and `Δ RSS` over the RSS after loading the target;
* for the cache configuration, the cache size per token on disk.

`--shipped` instead measures the shape of the shipped drafts (`research/2026-12-02-round1-drafts/train_dspark.yaml`:
one layer, Markov rank 64, an 8,192-token draft vocabulary, 48 anchors, batch 4, feature cache) on 256-token
sequences, once with the training label over the full vocabulary (the trainer's) and once with the earlier
label renormalised over the subset (`old-label`: no log-partition), to show what the fix costs per step.

Usage:
    python benchmarks/bench_train_cost.py [--steps 24] [--threads 2] [--shipped] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = [  # (sequence length, anchors per sequence, mode)
    (256, 32, "online"),
    (512, 32, "online"),
    (512, 64, "online"),
    (512, 64, "cache"),
]
SHIPPED_CONFIGS = [(256, 48, "shipped"), (256, 48, "shipped-old-label")]


def current_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def synthetic_dataset(tokenizer, vocab: int, seq_len: int, count: int, seed: int = 0):
    from dspark_hf.train import TokenDataset

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain why the sky is blue."}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(count):
        response = torch.randint(0, vocab, (seq_len - len(prompt),), generator=g).tolist()
        seqs.append((prompt + response, [0] * len(prompt) + [1] * len(response)))
    return TokenDataset(seqs)


def run_one(seq_len: int, anchors: int, mode: str, steps: int, threads: int) -> dict:
    from dspark_hf.default_model import load_default_target
    from dspark_hf.train import DataArguments, FeatureCache, ModelArguments, TrainArguments, target_features, train

    torch.set_num_threads(threads)
    target, tok = load_default_target()
    rss_after_target = current_rss_mb()
    shipped = mode.startswith("shipped")
    batch = 4 if shipped else 1
    ds = synthetic_dataset(tok, target.config.vocab_size, seq_len, count=steps * batch)
    if shipped:  # research/2026-12-02-round1-drafts/train_dspark.yaml
        model_args = ModelArguments(num_hidden_layers=1, markov_rank=64, draft_vocab_size=8192)
    else:
        model_args = ModelArguments()  # 2 draft layers, γ = 7, Markov rank 256, confidence head
    if mode == "shipped-old-label":  # the label before the fix: target renormalised over the subset
        from dspark_hf.train import trainer as trainer_mod

        trainer_mod.target_log_partition = lambda *a, **kw: None
    layer_ids = [1, 8, 14, 20, 27] if not shipped else None
    if layer_ids is None:
        from dspark_hf.model.configuration import default_target_layer_ids

        layer_ids = default_target_layer_ids(target.config.num_hidden_layers)
    ids = ds[0][0][None]
    for _ in range(2):
        target_features(target, layer_ids, ids)
    t0 = time.perf_counter()
    for _ in range(3):
        target_features(target, layer_ids, ids)
    target_ms = (time.perf_counter() - t0) / 3 * 1000

    result = {"seq_len": seq_len, "anchors": anchors, "mode": mode, "target_ms": target_ms}
    with tempfile.TemporaryDirectory() as tmp:
        cache_root = None
        if mode == "cache" or shipped:
            cache_root = Path(tmp) / "cache"
            t0 = time.perf_counter()
            FeatureCache.build(target, ds, layer_ids, cache_root, progress=False)
            result["cache_build_s"] = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in cache_root.rglob("*.safetensors"))
            result["cache_bytes_per_token"] = size / ds.num_tokens
        records = []
        train(
            model_args,
            DataArguments(num_anchors=anchors, eval_ratio=0.0, feature_cache=str(cache_root) if cache_root else None),
            TrainArguments(
                output_dir=str(Path(tmp) / "run"),
                max_steps=steps,
                per_device_batch_size=batch,
                report_to="none",
                progress=False,
            ),
            target=target,
            train_dataset=ds,
            callbacks=[lambda state: records.append(state.metrics)],
        )
        written = sum(p.stat().st_size for p in (Path(tmp) / "run").rglob("*") if p.is_file())
    timed = records[2:]
    result.update(
        seconds_per_step=statistics.median(batch * seq_len / r["tokens_per_s"] for r in timed),
        batch=batch,
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
        ms_per_slot=1000 / statistics.median(r["slots_per_s"] for r in timed),
        slots_per_step=statistics.median(r["slots_per_s"] / r["tokens_per_s"] * seq_len for r in timed),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        rss_after_target_mb=rss_after_target,
        run_dir_bytes=written,
        final_loss=records[-1]["loss"],
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--shipped", action="store_true", help="the shipped drafts' shape, new vs old label")
    parser.add_argument("--one", nargs=3, metavar=("SEQ_LEN", "ANCHORS", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(int(args.one[0]), int(args.one[1]), args.one[2], args.steps, args.threads)))
        return
    rows = []
    for seq_len, anchors, mode in SHIPPED_CONFIGS if args.shipped else CONFIGS:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            str(seq_len),
            str(anchors),
            mode,
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"T={seq_len:4d} N={anchors:3d} B={r['batch']} {mode:6s}: {r['seconds_per_step']:6.2f} s/step "
            f"{r['tokens_per_s']:7.1f} tok/s  {r['ms_per_slot']:6.2f} ms/slot  "
            f"target fwd {r['target_ms']:6.1f} ms  peak RSS {r['peak_rss_mb']:6.0f} MB "
            f"(+{r['peak_rss_mb'] - r['rss_after_target_mb']:.0f} over target)"
            + (f"  cache {r['cache_bytes_per_token'] / 1024:.1f} KB/token" if mode == "cache" else ""),
            flush=True,
        )
    meta = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "steps": args.steps,
        "torch": torch.__version__,
    }
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
