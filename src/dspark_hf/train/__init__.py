"""Training DSpark drafts: data preparation, target features, losses, the `accelerate` trainer, LoRA.

```python
from dspark_hf.train import PrepareDataArguments, prepare_data, train, ModelArguments, DataArguments, TrainArguments

prepare_data(PrepareDataArguments(prompts="prompts.jsonl", output="data.jsonl"))
result = train(ModelArguments(num_hidden_layers=2), DataArguments(train_data="data.jsonl"),
               TrainArguments(output_dir="my-draft", max_steps=1000))
```

Modules, in data-flow order: `data` (prompts → target-regenerated token ids + loss mask), `features` (the
target's hidden states, online or from a safetensors cache), `losses` (pure functions: anchors, blocks,
CE + L1 + confidence BCE, acceptance estimates), `surgery` (the starting draft: grown, upgraded, from the
target's layers), `step` (one micro-batch, held-out evaluation), `trainer` (the loop), `checkpoint` (atomic,
exact resume), `lora` (peft adapters), `args` (dataclass arguments + YAML).

`import dspark_hf` does not import this package. Importing it needs only torch and transformers; accelerate,
peft, PyYAML and TensorBoard (the `train` extra) are imported by the functions that use them, which raise an
`ImportError` naming the extra when one is missing.
"""

from .args import (
    DataArguments,
    LoraArguments,
    ModelArguments,
    PrepareDataArguments,
    TrainArguments,
    parse_args,
)
from .data import TokenDataset, load_token_dataset, prepare_data, to_conversation, tokenize_conversation
from .features import FeatureCache, TargetFeatures, target_features, target_log_partition, target_logits
from .lora import apply_lora, load_draft_with_adapter, merge_adapter
from .losses import (
    Blocks,
    LossOutput,
    acceptance_estimates,
    build_blocks,
    dspark_loss,
    position_weights,
    sample_anchors,
)
from .step import evaluate
from .trainer import TrainResult, TrainState, train

__all__ = [
    "Blocks",
    "DataArguments",
    "FeatureCache",
    "LoraArguments",
    "LossOutput",
    "ModelArguments",
    "PrepareDataArguments",
    "TargetFeatures",
    "TokenDataset",
    "TrainArguments",
    "TrainResult",
    "TrainState",
    "acceptance_estimates",
    "apply_lora",
    "build_blocks",
    "dspark_loss",
    "evaluate",
    "load_draft_with_adapter",
    "load_token_dataset",
    "merge_adapter",
    "parse_args",
    "position_weights",
    "prepare_data",
    "sample_anchors",
    "target_features",
    "target_log_partition",
    "target_logits",
    "to_conversation",
    "tokenize_conversation",
    "train",
]
