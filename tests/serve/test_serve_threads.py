"""The server's decoding thread must be the only thread of the process that owns an OpenMP pool.

GNU OpenMP keeps a pool of helper threads per thread that opens a parallel region. Loading the models on the main
thread and decoding in the engine's worker thread, as `dspark serve` did, gave the process two pools; with more
pooled threads than CPUs, libgomp stops its idle threads from spinning and every parallel region of every later
forward pays a sleep and a wake-up (`dspark_hf._threads`). The symptom is a count: voluntary context switches of
the process while a long-lived thread runs parallel kernels. These tests run in a fresh subprocess each (the pools
of this test process are whatever earlier tests left), and each has a negative control that puts the old
behaviour back and must show the symptom, so a test that passes also shows it could fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: MODE says how the one-off "loading" work (a parallel kernel) is done, then a
# long-lived worker thread runs parallel kernels as the engine worker would, and the script prints the process's
# voluntary context switches over the worker's run.
PROBE = r"""
import json, resource, sys, threading
import torch

torch.set_num_threads(2)
mode, folder = sys.argv[1], sys.argv[2]
big = torch.empty(1 << 22)  # not filled: a fill would itself be a parallel region on this thread

def parallel_work():  # ~4M elements: far above ATen's grain size, so it opens an OpenMP parallel region
    big.exp().sum()

if mode in ("main", "load_app_on_main"):
    parallel_work()  # the old way: one-off work on this (the main) thread
elif mode == "fresh":
    from dspark_hf._threads import run_in_fresh_thread
    run_in_fresh_thread(parallel_work)
if mode.startswith("load_app"):
    import dspark_hf.default_model as default_model
    from dspark_hf.serve import load_app

    real_load_target = default_model.load_target
    on_main = []

    def load_target(*args, **kwargs):  # a loader that runs parallel kernels (dtype casts, copies) as real ones do
        on_main.append(threading.current_thread() is threading.main_thread())
        parallel_work()
        return real_load_target(*args, **kwargs)

    default_model.load_target = load_target
    load_app(folder, policy="none")

on_main = globals().get("on_main", [])
before = after = None
def worker():
    global before, after
    parallel_work()  # the worker's own pool is made before counting
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for _ in range(300):
        parallel_work()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw

thread = threading.Thread(target=worker)
thread.start()
thread.join()
print(json.dumps({"switches": after - before, "loaded_on_main": on_main}))
"""


def _libgomp_in_use() -> bool:
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or not _libgomp_in_use(),
    reason="the per-thread OpenMP pools matter with GNU OpenMP (Linux torch wheels) and two or more threads",
)


def _probe(mode: str, folder: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("OMP_NUM_THREADS", None)  # the probe sets 2 threads itself (the suite's workers run on 1)
    env.pop("GOMP_SPINCOUNT", None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(folder)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    from train_helpers import make_char_tokenizer, make_chat_target

    folder = tmp_path_factory.mktemp("tiny-target")
    make_chat_target(dtype=torch.float32).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    return folder


_SEPARATES = 0.85  # a probed mode shows one pool when its switches stay below this share of the control's


def _separates(switches: int, control: int) -> bool:
    return switches < _SEPARATES * control


def _paired(mode: str, control_mode: str, folder: Path, attempts: int = 3) -> list[tuple[int, int, dict]]:
    """`(switches, control switches, probe output)` per attempt, stopping at the first clear separation.

    A pool left behind throttles every region the same way: the control's count is 4 per region (1,199-1,201 for
    300 regions in every probe, idle or next to a busy process), and a leftover pool in the probed mode gives the
    same. The one-pool modes give ~0 alone, but next to a busy process (the other test worker) their idle helper
    also sleeps now and then: 544-842 seen on a loaded host, up to 0.70 of the control. So the bar is 85% of the
    control's count (`_SEPARATES`): a leftover pool never clears it, a loaded host's one pool does."""
    pairs = []
    for _ in range(attempts):
        out = _probe(mode, folder)
        control = _probe(control_mode, folder)["switches"]
        pairs.append((out["switches"], control, out))
        if control > 300 and _separates(out["switches"], control):
            break
    return pairs


def test_work_in_a_fresh_thread_leaves_the_caller_no_pool(tiny_target):
    # negative control: the same work on the main thread. 300 parallel regions: with one pool, its idle threads
    # spin and hardly ever sleep; with two, each region costs sleeps and wake-ups (on 2 cores: 0 vs ~1,150)
    fresh, on_main, _ = _paired("fresh", "main", tiny_target)[-1]
    assert on_main > 300, f"the control shows no throttled pool ({on_main} switches): the test has no power here"
    assert _separates(fresh, on_main), (
        f"fresh-thread work left a pool: {fresh} switches vs {on_main} on the main thread"
    )


def test_load_app_loads_off_the_calling_thread(tiny_target):
    # negative control: the same load_app with the loader's kernels run on the main thread first
    pairs = _paired("load_app", "load_app_on_main", tiny_target)
    assert all(out["loaded_on_main"] == [False] for _, _, out in pairs), "load_app ran the loader on the calling thread"
    served, control, _ = pairs[-1]
    assert control > 300, f"the control shows no throttled pool ({control} switches): the test has no power here"
    assert _separates(served, control), f"load_app left the main thread a pool: {served} switches vs {control}"
