"""dspark-hf: lossless speculative decoding for Hugging Face causal LMs with DSpark drafts.

```python
import dspark_hf                      # registers the Auto classes and the generate() hook
draft = dspark_hf.DSparkDraftModel.from_target(target)
out = target.generate(**inputs, assistant_model=draft)
print(dspark_hf.last_generation_stats(draft).tau)
```

Importing this package stays light: it pulls in torch and transformers only (no accelerate, peft, datasets,
gradio or evaluate).
"""

from transformers import AutoConfig, AutoModel

from ._threads import run_in_fresh_thread
from ._version import __version__
from .decoding.engine import DSparkEngine, RequestOutput, SamplingParams
from .decoding.generation import DSparkCandidateGenerator, install_generate_hook
from .decoding.options import SpeculationOptions, resolve_options
from .decoding.stats import GenerationStats, RoundStats
from .kernels import (
    KERNEL_MODES,
    build_exact_kernels,
    default_kernels,
    kernels_of,
    pack_linear_weights,
    unpack_linear_weights,
    use_kernels,
)
from .model.configuration import DSparkConfig, default_target_layer_ids
from .model.formats import export_deepspec
from .model.modeling import DSparkDraftModel, DSparkOutput, load_deepspec_checkpoint, load_speculators_checkpoint
from .model.runs import last_generation_stats
from .model.speculators_format import export_speculators
from .scheduling.policies import (
    AdaptivePolicy,
    ConfidenceThresholdPolicy,
    FixedPolicy,
    HardwareAwarePolicy,
    LaggedHardwareAwarePolicy,
    ThresholdPolicy,
    UniformHardwareAwarePolicy,
    VerificationPolicy,
    resolve_policy,
)
from .scheduling.sps import SPSProfile, get_sps_profile, profile_sps

AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDraftModel, exist_ok=True)
install_generate_hook()

__all__ = [
    "KERNEL_MODES",
    "DSparkCandidateGenerator",
    "DSparkConfig",
    "DSparkDraftModel",
    "DSparkEngine",
    "last_generation_stats",
    "DSparkOutput",
    "AdaptivePolicy",
    "FixedPolicy",
    "GenerationStats",
    "HardwareAwarePolicy",
    "LaggedHardwareAwarePolicy",
    "SPSProfile",
    "RequestOutput",
    "RoundStats",
    "SamplingParams",
    "SpeculationOptions",
    "ThresholdPolicy",
    "ConfidenceThresholdPolicy",
    "UniformHardwareAwarePolicy",
    "VerificationPolicy",
    "build_exact_kernels",
    "default_kernels",
    "default_target_layer_ids",
    "export_deepspec",
    "export_speculators",
    "get_sps_profile",
    "profile_sps",
    "kernels_of",
    "load_deepspec_checkpoint",
    "load_speculators_checkpoint",
    "pack_linear_weights",
    "resolve_options",
    "resolve_policy",
    "run_in_fresh_thread",
    "unpack_linear_weights",
    "use_kernels",
    "__version__",
]
