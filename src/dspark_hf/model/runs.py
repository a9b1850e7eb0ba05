"""What each draft's latest speculative `generate()` call recorded, kept beside the draft, never on the module.

`generate(assistant_model=draft)` records its [`GenerationStats`] here when it starts and updates them while it runs
(so a streamer can read them live); [`last_generation_stats`] reads them. A weak reference: a draft that is gone
frees its record. The engine's requests carry their own stats (`RequestOutput.stats`).
"""

from __future__ import annotations

import weakref

_LAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_generation_stats(draft, stats) -> None:
    """Record `stats` as `draft`'s latest `generate()` call's (done by the call itself)."""
    _LAST[draft] = stats


def last_generation_stats(draft):
    """The [`GenerationStats`] of the latest `generate(assistant_model=draft)` call (per-round τ, lengths,
    acceptance; updated live while it runs), or `None` before the first call.

    Example:

    ```python
    >>> out = target.generate(ids, assistant_model=draft, max_new_tokens=64)
    >>> last_generation_stats(draft).tau
    ```
    """
    return _LAST.get(draft)
