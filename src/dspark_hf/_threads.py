"""Running torch work in a short-lived thread, so that a long-lived caller owns no OpenMP thread pool.

Why this exists. PyTorch's CPU kernels parallelise with OpenMP, and GNU OpenMP (the `libgomp` that the torch
wheels ship) keeps one pool of helper threads *per thread that opens a parallel region*. A process that loads its
models on the main thread (which opens a few parallel regions: dtype casts, copies) and then decodes in a worker
thread, as `dspark serve` does, owns two pools. Once the pools' threads together outnumber the CPUs, libgomp cuts
the time its idle threads spin before sleeping to almost nothing (its "throttled" spin count), so every parallel
region of every later forward pays a futex sleep and wake-up: on a 2-core CPU we counted ~70,000 voluntary
context switches over 69 engine rounds instead of ~400, and target forwards ran 5-35% slower (`docs/serving.md`).
A pool ends with the thread that owns it, so doing that one-off work in a thread that then exits leaves the
decoding thread the only owner of a pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_in_fresh_thread(fn: Callable[[], T], name: str = "dspark-load") -> T:
    """Call `fn()` in a new thread, wait for it, and return its result (or raise its exception here).

    Any OpenMP pool that `fn`'s torch work creates ends with that thread, so the caller (typically the main
    thread of a server whose decoding runs in another thread) keeps none.
    """
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # re-raised in the caller, with its traceback
            box["error"] = err

    # a daemon, so that Ctrl-C in the caller during a long load ends the process instead of waiting for it
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
