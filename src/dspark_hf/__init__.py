"""dspark-hf: lossless speculative decoding for Hugging Face causal LMs with DSpark drafts.

```python
import dspark_hf                      # registers the Auto classes and the generate() hook
draft = dspark_hf.DSparkDraftModel.from_target(target)
out = target.generate(**inputs, assistant_model=draft)
print(draft.last_generation_stats.tau)
```

Importing this package stays light: it pulls in torch and transformers only (no accelerate, peft, datasets,
gradio or evaluate).
"""

__version__ = "0.1.0"

from transformers import AutoConfig, AutoModel

from .configuration import DSparkConfig, default_target_layer_ids
from .convert import export_deepspec, load_deepspec_checkpoint
from .cpu_packing import pack_linear_weights, packed_linears, set_cpu_packing, unpack_linear_weights
from .engine import DSparkEngine, RequestOutput, SamplingParams
from .generation import DSparkCandidateGenerator, install_generate_hook
from .modeling import DSparkDraftModel, DSparkOutput
from .scheduler import (
    ConfidenceThresholdPolicy,
    FixedPolicy,
    HardwareAwarePolicy,
    LaggedHardwareAwarePolicy,
    ThresholdPolicy,
    UniformHardwareAwarePolicy,
    VerificationPolicy,
    resolve_policy,
)
from .speculators_format import export_speculators, load_speculators_checkpoint
from .sps import SPSProfile, get_sps_profile, profile_sps
from .stats import GenerationStats, RoundStats

AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDraftModel, exist_ok=True)
install_generate_hook()

__all__ = [
    "DSparkCandidateGenerator",
    "DSparkConfig",
    "DSparkDraftModel",
    "DSparkEngine",
    "DSparkOutput",
    "FixedPolicy",
    "GenerationStats",
    "HardwareAwarePolicy",
    "LaggedHardwareAwarePolicy",
    "SPSProfile",
    "RequestOutput",
    "RoundStats",
    "SamplingParams",
    "ThresholdPolicy",
    "ConfidenceThresholdPolicy",
    "UniformHardwareAwarePolicy",
    "VerificationPolicy",
    "default_target_layer_ids",
    "export_deepspec",
    "export_speculators",
    "get_sps_profile",
    "profile_sps",
    "load_deepspec_checkpoint",
    "load_speculators_checkpoint",
    "pack_linear_weights",
    "packed_linears",
    "resolve_policy",
    "set_cpu_packing",
    "unpack_linear_weights",
    "__version__",
]
