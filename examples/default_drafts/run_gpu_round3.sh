#!/usr/bin/env bash
# Round 3 of the default drafts on one CUDA GPU, in one time-boxed run: data, then both drafts side by side.
#   1. the default target de-quantised from its GGUF (fp32),
#   2. `dspark prepare-data` with prepare_round3.yaml (batched generate(), chunks of 512) for DATA_S seconds;
#      whole chunks are kept (the prompt file's chunks are shuffled, so a stop keeps every length and source),
#   3. 2% of the conversations held out (round2_data.py split --round1 none),
#   4. a probe: both drafts train side by side for PROBE_STEPS steps; from its step times, the number of steps
#      that fits what is left of BUDGET_S (minus RESERVE_S for packing) for the slower of the two,
#   5. both drafts train side by side for that many steps (same data, steps, seed; each evaluates its
#      held-out estimate at the end),
#   6. the drafts packed as fp16 (to carry them back under the size limit), logs and metrics archived.
# A smoke test on a CPU: PREP_EXTRA="--device cpu --max_prompts 8 --batch_size 4 --max_new_tokens 24"
#   TRAIN_EXTRA="--per_device_batch_size 2 --num_anchors 4" BUDGET_S=400 DATA_S=120 PROBE_STEPS=8 run_gpu_round3.sh ...
# Usage: examples/default_drafts/run_gpu_round3.sh GGUF_FILE WORK_DIR OUT_DIR   (from the repository root, with
#   data/ holding prompts_round3.jsonl from round3_data.py). Logs go to WORK_DIR; OUT_DIR receives at most seven
#   files of at most 15 MB (what a size-limited copy back can take): logs.tgz (always, also after a failure),
#   the packed drafts (split into parts) and the regenerated data (gzip, split).
set -u
start=$(date +%s)
budget=${BUDGET_S:-540} data_s=${DATA_S:-170} reserve=${RESERVE_S:-25} probe_steps=${PROBE_STEPS:-25}
gguf=$1 out=$2 final=$3
mkdir -p "$final"
trap 'tar czf "$final/logs.tgz" --exclude="*.safetensors" -C "$out" . 2>/dev/null' EXIT
left() { echo $((budget - ($(date +%s) - start))); }
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$out" data/runs
log() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$out/stages.log"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  $py -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
  nproc; } >"$out/machine.txt" 2>&1

log "target"
$py examples/default_drafts/round3_gpu.py target --gguf "$gguf" --out data/target >"$out/target.log" 2>&1 || { log "target failed"; exit 1; }

log "prepare-data for ${data_s} s"
timeout "$data_s" $py -m dspark_hf.cli prepare-data --config examples/default_drafts/prepare_round3.yaml \
  --target data/target --progress true ${PREP_EXTRA:-} >"$out/prepare.log" 2>&1
log "prepare-data stopped: $(wc -l <data/regenerated_round3.jsonl) conversations"
$py examples/default_drafts/round2_data.py split --round1 none --round2 data/regenerated_round3.jsonl \
  --train-output data/train_round3.jsonl --eval-output data/eval_round3.jsonl >>"$out/stages.log" 2>&1

train() {  # preset max_steps output_dir times_file
  $py examples/default_drafts/round3_gpu.py train --times "$4" --config "examples/default_drafts/train_round3_$1.yaml" \
    --target data/target --max_steps "$2" --output_dir "$3" --save_steps 0 ${TRAIN_EXTRA:-}
}
log "probe: ${probe_steps} steps side by side"
train dspark "$probe_steps" data/runs/probe-dspark "$out/probe-dspark.json" >"$out/probe-dspark.log" 2>&1 &
train dflash "$probe_steps" data/runs/probe-dflash "$out/probe-dflash.json" >"$out/probe-dflash.log" 2>&1 &
wait
steps=$($py examples/default_drafts/round3_gpu.py steps --times "$out/probe-dspark.json" "$out/probe-dflash.json" \
  --seconds "$(($(left) - reserve))" 2>>"$out/stages.log") || { log "probe failed"; exit 1; }
log "training both drafts for ${steps} steps"
train dspark "$steps" data/runs/dspark-round3 "$out/times-dspark.json" >"$out/train-dspark.log" 2>&1 &
train dflash "$steps" data/runs/dflash-round3 "$out/times-dflash.json" >"$out/train-dflash.log" 2>&1 &
wait
log "packing"
for p in dspark dflash; do
  $py examples/default_drafts/round3_gpu.py pack --run "data/runs/$p-round3" --out "$out/$p-round3.fp16.safetensors" \
    >>"$out/stages.log" 2>&1
  cp "data/runs/$p-round3/config.json" "$out/$p-round3.config.json" 2>/dev/null
  cp "data/runs/$p-round3/metrics.jsonl" "$out/$p-round3.metrics.jsonl" 2>/dev/null
  cp "data/runs/$p-round3/eval_results.json" "$out/$p-round3.eval_results.json" 2>/dev/null
  cp "data/runs/$p-round3/run_args.json" "$out/$p-round3.run_args.json" 2>/dev/null
done
$py - <<'PY' >>"$out/stages.log" 2>&1
import json
rows = [json.loads(line) for line in open("data/regenerated_round3.jsonl")]
n = sum(sum(m for m in s["loss_mask"]) for r in rows for s in r["sequences"])
t = sum(len(s["input_ids"]) for r in rows for s in r["sequences"])
print(f"data: {len(rows)} conversations, {t} tokens, {n} response tokens")
PY
split -b 15000000 -d "$out/dspark-round3.fp16.safetensors" "$final/dspark-round3.fp16.part"
cp "$out/dflash-round3.fp16.safetensors" "$final/"
log "done"
if [ "$(left)" -gt 5 ]; then
  gzip -c data/regenerated_round3.jsonl | split -b 15000000 -d -a 1 - "$final/regenerated_round3.jsonl.gz.part"
  n=$(ls "$final" | wc -l)
  if [ "$n" -gt 7 ]; then rm -f "$final"/regenerated_round3.jsonl.gz.part*; log "data not kept: $n files"; fi
fi
ls -la "$final" | tee -a "$out/stages.log"
