#!/usr/bin/env bash
# Issue 48 "nothing regressed": the main job and `dspark eval` (greedy, 8 prompts x 4 sets, 96 new tokens), before and
# after the redesign, interleaved (B A, then A B), 2 threads, on a quiet machine.
# Usage: run.sh BEFORE_SRC OUT   (BEFORE_SRC: the src/ folder of a `git worktree add <dir> 8504518`; the current
# checkout is "after")
set -u
before=$1 out=$2; mkdir -p "$out"
run() {  # tag kind rep
  local tag=$1 kind=$2 rep=$3 pp=""
  [ "$tag" = before ] && pp=$before
  export TORCH_EXTENSIONS_DIR="$out/ext-$tag"  # each tree builds its own exact kernels once
  if [ "$kind" = main ]; then
    PYTHONPATH=$pp OMP_NUM_THREADS=2 python -m dspark_hf.cli generate >"$out/main-$tag-$rep.log" 2>&1
  else
    PYTHONPATH=$pp OMP_NUM_THREADS=2 python -m dspark_hf.cli eval --limit 8 --temperatures 0 --max-new-tokens 96 \
      --repeats 1 --threads 2 --no-prompt-lookup --no-task-metrics --no-progress \
      --output "$out/eval-$tag-$rep" >"$out/eval-$tag-$rep.log" 2>&1
  fi
  echo "$(date +%T) $tag $kind $rep rc=$?"
}
for rep in 1 2; do
  for kind in main eval; do
    if [ $((rep % 2)) = 1 ]; then run before $kind $rep; run after $kind $rep; else run after $kind $rep; run before $kind $rep; fi
  done
done
