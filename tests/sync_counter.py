"""Count host synchronisations issued by dspark_hf code, on a CPU run, by modelling where each tensor lives.

On an accelerator every read of device data by the host (`.item()`, `int(t)`, `bool(t)`, `.tolist()`,
`.cpu()`, `.numpy()`, `.nonzero()`, indexing a list with a tensor) waits for the device, and so does a
blocking host→device copy (`torch.tensor(data, device=...)`, `host_tensor.to(device)`). On a CPU all tensors
share one memory, so this counter tracks a *placement* for every tensor, as it would be on an accelerator:

* tensors built from host data without a `device` argument (`torch.tensor([...])`, `torch.zeros(n)`, …),
  the result of `.cpu()`, and anything computed from host tensors only, are **host** tensors;
* a `device=` argument that was read off a host tensor (`device=host_tensor.device`, as the policies write)
  keeps the result on the host;
* everything else — parameters, model outputs, the prompt, factories called with `device=`, and anything
  computed from at least one device tensor — is a **device** tensor.

A read of a device tensor, a `.cpu()` of one, and a host→device transfer count as one sync each, when the
innermost Python frame outside torch that issued it belongs to `src/dspark_hf/` (transformers' own reads
inside `generate()` are not ours) or to a file listed in `extra_files` (a negative control's injected code).
"""

from __future__ import annotations

import collections
import sys
import weakref
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

_PACKAGE = str(Path(__file__).resolve().parents[1] / "src" / "dspark_hf")
_TORCH = str(Path(torch.__file__).resolve().parent)

_READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "numpy", "nonzero"}
_FACTORIES = {
    "tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "randint", "rand", "randn", "linspace",
    "eye", "randperm", "tril_indices", "triu_indices",
}  # fmt: skip
_FROM_DATA = {"tensor", "as_tensor"}
_DEVICE_DESCRIPTOR = torch.Tensor.device


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class SyncCounter(TorchFunctionMode):
    """`with SyncCounter() as c: ...` then `c.total`, `c.by_site` (`(kind, "file:line") → count`)."""

    def __init__(self, extra_files: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.host: dict[int, weakref.ref] = {}  # id → weak reference (tensors compare elementwise)
        self.by_site: collections.Counter = collections.Counter()
        self.extra_files = tuple(str(Path(f).resolve()) for f in extra_files)
        self.enabled = True
        self.host_devices: dict[int, torch.device] = {}  # `.device` objects read off host tensors (kept alive)

    @property
    def total(self) -> int:
        return sum(self.by_site.values())

    def _site(self) -> str | None:
        frame = sys._getframe(1)
        while frame is not None and (
            frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(_TORCH)
        ):  # this counter's own frames, then torch's (e.g. Tensor.__index__ wrappers)
            frame = frame.f_back
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE) or name in self.extra_files:
            return f"{name.rsplit('/src/', 1)[-1].rsplit('/tests/', 1)[-1]}:{frame.f_lineno}"
        return None

    def _count(self, kind: str) -> None:
        if self.enabled and (site := self._site()) is not None:
            self.by_site[(kind, site)] += 1

    def _names_device(self, args, kwargs) -> bool:
        """A device argument that is not one read off a host tensor."""
        given = [kwargs.get("device")] + [a for a in args if isinstance(a, (torch.device, str))]
        given = [d for d in given if d is not None]
        return any(id(d) not in self.host_devices or self.host_devices[id(d)] is not d for d in given)

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self.host.get(id(t))
        return ref is not None and ref() is t

    def _mark_host(self, t: torch.Tensor) -> None:
        self.host[id(t)] = weakref.ref(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        if name in _READS and inputs and not self._is_host(inputs[0]):
            self._count(name)
        out = func(*args, **kwargs)
        if getattr(func, "__self__", None) is _DEVICE_DESCRIPTOR:  # `t.device`
            if inputs and self._is_host(inputs[0]):
                self.host_devices[id(out)] = out
            return out
        outputs = list(_tensors(out))
        if not outputs:
            return out
        if name in _FACTORIES:
            on_device = self._names_device((), kwargs)
            if name in _FROM_DATA and on_device and not any(isinstance(a, torch.Tensor) for a in args[:1]):
                self._count("h2d:" + name)
            host = not on_device
        elif name == "cpu":
            if inputs and not self._is_host(inputs[0]):
                self._count("cpu")
            host = True
        elif name == "to" and self._names_device(args[1:], kwargs):
            src_host = bool(inputs) and self._is_host(inputs[0])
            if src_host:
                self._count("h2d:to")
            host = False
        elif name.endswith("_like") and inputs:
            host = self._is_host(inputs[0]) and kwargs.get("device") is None
        elif name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
            # in place: the target becomes device data if anything written into it is
            if inputs and self._is_host(inputs[0]) and not all(self._is_host(t) for t in inputs[1:]):
                self.host.pop(id(inputs[0]), None)
            return out
        else:
            host = bool(inputs) and all(self._is_host(t) for t in inputs)
        if host:
            for t in outputs:
                self._mark_host(t)
        return out
