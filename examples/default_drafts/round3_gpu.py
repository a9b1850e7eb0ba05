"""Helpers of `run_gpu_round3.sh` (round 3 of the default drafts on one GPU).

round3_gpu.py target --gguf FILE --out FOLDER      # de-quantise the default target's GGUF to an HF folder
round3_gpu.py train --config YAML [train options] --times FILE
                                                   # `dspark train`, recording when each step ended
round3_gpu.py steps --times A.json B.json --seconds S
                                                   # how many steps of two concurrent runs fit in S seconds
round3_gpu.py pack --run FOLDER --out FILE         # the trained draft as fp16 safetensors (to carry it back)
round3_gpu.py unpack --packed FILE --config CONFIG --out FOLDER
                                                   # back to an fp32 draft folder
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()


def convert_target(gguf: Path, out: Path) -> None:
    from dspark_hf.default_model import convert_default_target

    try:
        convert_default_target(gguf, out)
    except ValueError as err:
        raise SystemExit(str(err)) from err
    print(f"converted {gguf.name} to {out}")


def train_timed(argv: list[str], times_path: Path) -> None:
    from dspark_hf.train.args import TRAIN_ARGUMENT_TYPES, args_from_namespace, build_argument_parser
    from dspark_hf.train.trainer import train

    parser = build_argument_parser(TRAIN_ARGUMENT_TYPES)
    model_args, data_args, train_args, lora_args = args_from_namespace(TRAIN_ARGUMENT_TYPES, parser.parse_args(argv))
    ends: list[float] = []

    def record(state) -> None:
        ends.append(time.perf_counter() - STARTED)
        if state.step == state.max_steps or state.step % 50 == 0:
            times_path.write_text(json.dumps({"step_ends": ends}))

    result = train(model_args, data_args, train_args, lora_args, callbacks=[record])
    times_path.write_text(json.dumps({"step_ends": ends, "total": time.perf_counter() - STARTED}))
    print(f"{result.output_dir}: {result.global_step} steps, held-out {result.eval_metrics}")


def fit_steps(paths: list[Path], seconds: float, skip: int = 5) -> int:
    """Steps that fit in `seconds` for the slowest of runs timed side by side: the start-up (import, target,
    data, the first `skip` steps) plus median step time times the steps, plus the final evaluation (taken as
    the start-up again, a generous bound)."""
    fits = []
    for path in paths:
        ends = json.loads(path.read_text())["step_ends"]
        step = statistics.median(b - a for a, b in zip(ends[skip:], ends[skip + 1 :]))
        startup = ends[skip]
        fits.append(int((seconds - 2 * startup) / step) + skip)
        print(
            f"{path.name}: start-up {startup:.1f} s, {step * 1e3:.0f} ms/step -> {fits[-1]} steps in {seconds:.0f} s",
            file=sys.stderr,
        )
    return max(min(fits), 1)


def pack(run: Path, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(run / "model.safetensors")
    big = max(float(t.abs().max()) for t in tensors.values() if t.is_floating_point())
    if big > 6e4:
        raise SystemExit(f"a weight of {big} does not fit fp16")
    save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}, out)
    print(f"packed {run} -> {out} ({out.stat().st_size / 1e6:.1f} MB)")


def unpack(packed: Path, config: Path, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(packed)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in tensors.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    values = json.loads(config.read_text())
    # the GPU run loaded the target from a local folder; the draft is for the Hub model
    values["target_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    (out / "config.json").write_text(json.dumps(values, indent=2) + "\n")
    print(f"unpacked {packed} -> {out}")


def plot(metrics: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for spec in metrics:
        name, path = spec.split("=", 1)
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        train = [r for r in rows if r["split"] == "train"]
        window = 5  # the logged steps are single batches: a running mean over 5 of them (100 steps)
        steps = [r["step"] for r in train][window - 1 :]
        taus = [
            statistics.mean(r["tau_est"] for r in train[i - window + 1 : i + 1]) for i in range(window - 1, len(train))
        ]
        (line,) = ax.plot(steps, taus, label=f"{name}: training batches (mean of 5 logs)")
        for r in rows:
            if r["split"] == "eval":
                ax.plot([r["step"]], [r["tau_est"]], "o", color=line.get_color())
                ax.annotate(
                    f"held-out {r['tau_est']:.3f}",
                    (r["step"], r["tau_est"]),
                    textcoords="offset points",
                    xytext=(-90, -14 if name.startswith("dflash") else 6),
                )
    ax.set_xlabel("optimizer step (16 sequences)")
    ax.set_ylabel("tau_est (whole block verified)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("target")
    t.add_argument("--gguf", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("train")
    r.add_argument("--times", type=Path, required=True)
    s = sub.add_parser("steps")
    s.add_argument("--times", type=Path, nargs="+", required=True)
    s.add_argument("--seconds", type=float, required=True)
    p = sub.add_parser("pack")
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    u = sub.add_parser("unpack")
    u.add_argument("--packed", type=Path, required=True)
    u.add_argument("--config", type=Path, required=True)
    u.add_argument("--out", type=Path, required=True)
    g = sub.add_parser("plot")
    g.add_argument("--metrics", nargs="+", required=True)
    g.add_argument("--out", type=Path, required=True)
    args, rest = parser.parse_known_args()
    if args.command == "target":
        convert_target(args.gguf, args.out)
    elif args.command == "train":
        train_timed(rest, args.times)
    elif args.command == "steps":
        print(fit_steps(args.times, args.seconds))
    elif args.command == "pack":
        pack(args.run, args.out)
    elif args.command == "unpack":
        unpack(args.packed, args.config, args.out)
    else:
        plot(args.metrics, args.out)


if __name__ == "__main__":
    main()
