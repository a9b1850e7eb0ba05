"""The target's CPU backend: kernel modes `"stock"`, `"packed"`, `"exact"` and `"exact-bf16"`, entered through one door.

```python
from dspark_hf.kernels import default_kernels, use_kernels

with use_kernels(target, draft, mode=default_kernels(target)):   # "exact" for a float32 CPU Llama/Qwen target
    ...
```

* `modes.py`: the mode names, the library's one default ([`default_kernels`]) and [`use_kernels`], the one
  context manager every caller enters (no process-wide setting, no environment variable);
* `build.py`: the C++ extension (`exact_kernels.cpp`), built at first use and cached;
* `ops.py`: the batch-invariant operations (linear, attention over a KV cache, the draft's RMSNorm);
* `lean.py`, `lean_model.py`: decoder layers and base models as a few compiled calls;
* `exact.py`: the exact mode's swaps and their undoing;
* `packed.py`: oneDNN packed linear weights.

Every use of transformers' private API goes through `dspark_hf._transformers`.
"""

from .build import build_exact_kernels, exact_kernels_backend, exact_kernels_build
from .lean import is_lean, lean_arguments, lean_bf16
from .lean_model import is_lean_model
from .modes import EXACT_MODES, KERNEL_MODES, check_kernels, default_kernels, exact_family, kernels_of, use_kernels
from .ops import (
    EXACT_ATTENTION,
    EXACT_ATTENTION_BF16,
    exact_attention_forward,
    exact_attention_forward_bf16,
    exact_linear,
    is_exact,
    is_exact_bf16,
    is_exact_norm,
)
from .packed import is_packed, pack_linear_weights, packing_available, unpack_linear_weights

__all__ = [
    "EXACT_ATTENTION",
    "EXACT_ATTENTION_BF16",
    "EXACT_MODES",
    "KERNEL_MODES",
    "build_exact_kernels",
    "check_kernels",
    "default_kernels",
    "exact_attention_forward",
    "exact_attention_forward_bf16",
    "exact_family",
    "exact_kernels_backend",
    "exact_kernels_build",
    "exact_linear",
    "is_exact",
    "is_exact_bf16",
    "is_exact_norm",
    "is_lean",
    "is_lean_model",
    "is_packed",
    "kernels_of",
    "lean_arguments",
    "lean_bf16",
    "pack_linear_weights",
    "packing_available",
    "unpack_linear_weights",
    "use_kernels",
]
