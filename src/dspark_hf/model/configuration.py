"""`DSparkConfig`: every hyper-parameter of a DSpark draft, validated on construction.

The config describes the draft only. It records *where it came from* (the target's name, revision
and shape, the package version) but never copies the target's own config, so a draft checkpoint stays
small and readable.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

from .._transformers import commit_hash

SEQUENTIAL_HEADS = ("markov", "gated", "rnn", "none")
LAYER_STYLES = ("qwen3", "gemma4")
# Rotary types the draft layers compute exactly as transformers' rotary classes do. "dynamic" and "longrope"
# change their frequencies with the sequence length at run time and are refused rather than approximated.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
EMBEDDING_LAYER_ID = -1  # in `target_layer_ids`: the target's embedding output (DeepSpec's convention)


def rope_parameters_of(text_config: Any) -> dict:
    """The rotary parameters a draft for `text_config` uses: its own, or its full-attention layers' ones.

    Models whose layer types use different rotaries (Gemma 3/4: sliding and full attention) store one dict per
    layer type; DSpark draft layers are full-attention layers, so they take the `"full_attention"` entry.
    """
    rope = getattr(text_config, "rope_parameters", None)
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    if not isinstance(rope, dict) or not rope:
        theta = getattr(text_config, "rope_theta", None) or 10000.0
        return {"rope_type": "default", "rope_theta": float(theta)}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", getattr(text_config, "rope_theta", None) or 10000.0)
    return {k: v for k, v in rope.items() if k != "type"} | {"rope_type": rope_type, "rope_theta": float(theta)}


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """Spread `num_features` target layers evenly from layer 1 to layer `L - 3`.

    This is the rule DFlash and DSpark use: early layers carry the lexical context, later ones the
    prediction, and the last layers are skipped because their output is already specialised for the
    target's own next-token head (the final `hidden_states` entry in transformers is even post-norm).

    Args:
        num_target_layers (`int`): number of decoder layers `L` of the target.
        num_features (`int`, *optional*, defaults to 5): how many layers to take (`m`).

    Returns:
        `list[int]`: sorted, distinct 0-based layer indices, all `< L - 1`.
    """
    if num_target_layers < 2:
        raise ValueError(
            f"The target has {num_target_layers} decoder layer(s); a DSpark draft needs a target with at least 2 "
            "so that it can read a layer other than the final one."
        )
    if num_features == 1 or num_target_layers < 5:
        return [max(0, min(num_target_layers // 2, num_target_layers - 2))]
    last = num_target_layers - 3
    ids = [round(1 + i * (last - 1) / (num_features - 1)) for i in range(num_features)]
    return sorted(set(ids))


class DSparkConfig(PreTrainedConfig):
    r"""Configuration of a [`DSparkDraftModel`].

    A DSpark draft has three parts: a *parallel backbone* that reads fused hidden states of the target
    and drafts a block of `block_size` tokens in one forward pass, a *sequential head* that corrects
    each drafted token's logits given the previous drafted token, and a *confidence head* that
    estimates how likely each drafted token is to survive verification.

    Args:
        vocab_size (`int`, *optional*, defaults to 32000):
            Vocabulary size; must equal the target's (the draft uses the target's embedding and LM head).
        hidden_size (`int`, *optional*, defaults to 1024):
            Width of the draft layers; must equal the target's hidden size.
        intermediate_size (`int`, *optional*, defaults to 2816): width of the draft layers' SwiGLU MLP.
        num_hidden_layers (`int`, *optional*, defaults to 5): number of draft decoder layers.
        num_attention_heads (`int`, *optional*, defaults to 16): query heads per draft layer.
        num_key_value_heads (`int`, *optional*, defaults to 8): key/value heads per draft layer (GQA).
        head_dim (`int`, *optional*): per-head width; defaults to `hidden_size // num_attention_heads`.
        rms_norm_eps (`float`, *optional*, defaults to 1e-6): epsilon of every RMSNorm.
        rope_theta (`float`, *optional*, defaults to 10000.0): rotary base of the draft layers; kept equal to
            `rope_parameters["rope_theta"]`.
        rope_parameters (`dict`, *optional*): the draft layers' rotary embedding in transformers' format
            (`rope_type` and its parameters, e.g. `{"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 32768}`), computed by transformers' own rotary functions.
            Supported types: `default`, `linear`, `yarn`, `llama3`, `proportional`; `dynamic` and `longrope`
            are refused. Defaults to plain rotary with `rope_theta`. [`DSparkConfig.from_target`] copies the
            target's (its full-attention layers' for Gemma).
        hidden_act (`str`, *optional*, defaults to `"silu"`): activation of the draft layers' gated MLP (any key
            of `transformers.activations.ACT2FN`); `from_target` copies the target's.
        layer_style (`str`, *optional*, defaults to `"qwen3"`): the draft layers' block. `"qwen3"`: pre-norm
            layer with q/k RMSNorm (DeepSpec's Qwen3 drafts and the speculators format). `"gemma4"`: DeepSpec's
            Gemma4 draft layer: sandwich norms around attention and MLP, an unscaled value norm, attention
            scale 1 and a learned per-layer scalar.
        attention_k_eq_v (`bool`, *optional*, defaults to `False`): `"gemma4"` only: values are the key
            projection (no `v_proj`), as in Gemma4's full-attention layers.
        final_logit_softcapping (`float`, *optional*): soft-cap `c·tanh(x/c)` applied to the base logits, as the
            target applies it to its own (Gemma).
        max_position_embeddings (`int`, *optional*, defaults to 32768): longest context the draft expects.
        attention_bias (`bool`, *optional*, defaults to `False`): bias on the q/k/v/o projections.
        initializer_range (`float`, *optional*, defaults to 0.02): std of the normal weight init.
        block_size (`int`, *optional*, defaults to 7): γ, the number of tokens drafted per round.
        sample_from_anchor (`bool`, *optional*, defaults to `True`): the block layout. `True` (DeepSpec's, and
            speculators' DSpark default): the backbone runs `[anchor, mask × (γ-1)]` and slot `k` drafts the token
            at `anchor + k + 1`. `False` (DFlash's layout, speculators' `sample_from_anchor: false`): the backbone
            runs `[anchor, mask × γ]` (γ + 1 slots) and slot `j ≥ 1` drafts the token at `anchor + j`; the anchor
            slot's output is unused. Either way `block_size` tokens are drafted and the sequential head reads the
            token before each drafted one (the anchor for the first); an `rnn` head's state also runs through the
            anchor slot in the `False` layout, as speculators trains it.
        layer_types (`list[str]`, *optional*): per draft layer, `"full_attention"` (the block sees all of its
            context and itself, bidirectionally) or `"sliding_attention"` (the block sees only the
            `sliding_window` context tokens before its anchor, and, unless `sliding_window_non_causal`, the slots of
            its block up to its own). `None` (the default): every layer is full attention.
        sliding_window (`int`, *optional*): W, the context tokens a sliding layer's block sees (positions
            `anchor - W … anchor - 1`); required when a layer is `"sliding_attention"`.
        sliding_window_non_causal (`bool`, *optional*, defaults to `False`): sliding layers attend within the block
            bidirectionally (as full layers do) instead of causally.
        target_layer_ids (`list[int]`, *optional*):
            0-based target layers whose outputs form the context features. Defaults to
            [`default_target_layer_ids`] of `target_num_hidden_layers`.
        mask_token_id (`int`, *optional*):
            Token whose (target) embedding fills the block slots after the anchor. Any id the target
            never produces works; defaults to the last id of the vocabulary.
        sequential_head (`str`, *optional*, defaults to `"markov"`):
            `"markov"` (low-rank first-order transition bias), `"gated"`, `"rnn"`, or `"none"`
            (plain DFlash-style parallel drafting).
        markov_rank (`int`, *optional*, defaults to 256): rank `r` of the sequential head.
        confidence_head (`bool`, *optional*, defaults to `True`): whether the draft predicts survival.
        confidence_with_markov (`bool`, *optional*, defaults to `True`):
            feed the previous token's Markov embedding to the confidence head besides the hidden state
            (ignored when `sequential_head="none"`).
        calibration_temperatures (`list[float]`, *optional*):
            one temperature per block position, applied to the confidence logits (Sequential
            Temperature Scaling). Defaults to all 1.0 (uncalibrated).
        confidence_calibrated (`bool`, *optional*, defaults to `False`): set by calibration; a calibrated
            draft defaults to the hardware-aware verification policy.
        draft_vocab_size (`int`, *optional*): `K`, the size of the draft-side vocabulary subset the draft
            proposes from at inference (the ids are the model's `draft_vocab_ids` buffer, saved with the
            weights). `None` (the default) is the full vocabulary. Set both with
            [`DSparkDraftModel.set_draft_vocab`]; see `docs/draft-vocab.md`.
        target_name_or_path (`str`, *optional*): provenance: the target this draft was built for.
        target_revision (`str`, *optional*): provenance: the target's revision (commit or tag).
        target_hidden_size (`int`, *optional*): provenance: the target's hidden size.
        target_vocab_size (`int`, *optional*): provenance: the target's vocabulary size.
        target_num_hidden_layers (`int`, *optional*): provenance: the target's number of decoder layers.
        target_weights_fingerprint (`dict`, *optional*): a few values of the target embedding / LM head that
            an imported checkpoint carried (DeepSpec and speculators drafts store copies); binding a target whose
            weights differ warns. Set on import, `None` otherwise.
        dspark_version (`str`, *optional*): provenance: the `dspark_hf` version that wrote the config.
    """

    model_type = "dspark"
    # A DSpark config cannot be built without knowing its target; older transformers releases (< 5.20)
    # instantiate `cls()` to diff against defaults unless told not to.
    has_no_defaults_at_init = True

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 5
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_parameters: dict | None = None
    hidden_act: str = "silu"
    layer_style: str = "qwen3"
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    initializer_range: float = 0.02
    block_size: int = 7
    sample_from_anchor: bool = True
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    sliding_window_non_causal: bool = False
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    sequential_head: str = "markov"
    markov_rank: int = 256
    confidence_head: bool = True
    confidence_with_markov: bool = True
    calibration_temperatures: list[float] | None = None
    confidence_calibrated: bool = False
    draft_vocab_size: int | None = None
    target_name_or_path: str | None = None
    target_revision: str | None = None
    target_hidden_size: int | None = None
    target_vocab_size: int | None = None
    target_num_hidden_layers: int | None = None
    target_weights_fingerprint: dict | None = None
    dspark_version: str | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        from .._version import __version__
        from .generation_defaults import check_legacy_fields

        # `default_policy` / `default_lookup` of older checkpoints: kept as plain attributes until the draft is
        # built, which moves them into its generation config (dspark_hf.model.generation_defaults)
        check_legacy_fields(kwargs)

        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.target_vocab_size is None:
            self.target_vocab_size = self.vocab_size
        if self.mask_token_id is None:
            self.mask_token_id = self.vocab_size - 1
        if self.target_layer_ids is None:
            if self.target_num_hidden_layers is None:
                raise ValueError(
                    "DSparkConfig needs either `target_layer_ids` or `target_num_hidden_layers` (from which the "
                    "default layer ids are derived). Build the config with `DSparkConfig.from_target(target)` or "
                    "pass one of them."
                )
            self.target_layer_ids = default_target_layer_ids(self.target_num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
        if self.calibration_temperatures is None:
            self.calibration_temperatures = [1.0] * self.block_size
        self.calibration_temperatures = [float(t) for t in self.calibration_temperatures]
        if self.dspark_version is None:
            self.dspark_version = __version__
        if not self.rope_parameters:
            self.rope_parameters = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        else:
            self.rope_parameters = dict(self.rope_parameters)
            self.rope_parameters.setdefault("rope_type", self.rope_parameters.pop("type", "default"))
            self.rope_parameters.setdefault("rope_theta", float(self.rope_theta))
            self.rope_theta = float(self.rope_parameters["rope_theta"])
        self.validate_dspark()
        super().__post_init__(**kwargs)

    # Named `validate_dspark` (not `validate`) so it never shadows transformers' own config checks.
    def validate_dspark(self) -> None:
        """Check every field; raise `ValueError` naming the field, the value, what is allowed and the fix."""
        self._validate_shape()
        self._validate_layers()
        self._validate_ids()
        self._validate_sizes()

    def _validate_shape(self) -> None:
        """Positive sizes, heads that group evenly, a known sequential head with a positive rank."""
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DSparkConfig.{name} must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DSparkConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}); pick a divisor, e.g. the target's KV head count."
            )
        if self.sequential_head not in SEQUENTIAL_HEADS:
            raise ValueError(
                f"DSparkConfig.sequential_head={self.sequential_head!r} is not supported; choose one of "
                f"{', '.join(repr(h) for h in SEQUENTIAL_HEADS)} ('none' gives a plain DFlash draft)."
            )
        if self.sequential_head != "none" and (not isinstance(self.markov_rank, int) or self.markov_rank < 1):
            raise ValueError(
                f"DSparkConfig.markov_rank must be a positive integer when sequential_head={self.sequential_head!r}, "
                f"got {self.markov_rank!r}. Use e.g. 64-256, or sequential_head='none' for no sequential head."
            )

    def _validate_ids(self) -> None:
        """The mask token inside the vocabulary; target layer ids increasing and within the target."""
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DSparkConfig.mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}); "
                "use an id the target never generates (e.g. an unused or padded row)."
            )
        ids = self.target_layer_ids
        if not ids:
            raise ValueError("DSparkConfig.target_layer_ids is empty; give at least one target layer index.")
        if ids != sorted(set(ids)):
            raise ValueError(
                f"DSparkConfig.target_layer_ids={ids} must be strictly increasing without repeats; "
                f"did you mean {sorted(set(ids))}?"
            )
        if ids[0] < EMBEDDING_LAYER_ID:
            raise ValueError(
                f"DSparkConfig.target_layer_ids={ids} contains {ids[0]}; allowed are 0-based layer indices and -1 "
                "(the target's embedding output, as in DeepSpec)."
            )
        n = self.target_num_hidden_layers
        if n is not None and ids[-1] >= n - 1:
            raise ValueError(
                f"DSparkConfig.target_layer_ids={ids} is out of range for a target with {n} layers: allowed are "
                f"-1 (the embedding output) and 0..{n - 2} (the final layer is excluded because its output is normalised for the LM head). "
                f"The default for this target is {default_target_layer_ids(n) if n >= 2 else 'undefined'}."
            )

    def _validate_sizes(self) -> None:
        """One calibration temperature per block position, the draft vocabulary within the vocabulary, and the
        hidden and vocabulary sizes the draft shares with the target."""
        if len(self.calibration_temperatures) != self.block_size:
            raise ValueError(
                f"DSparkConfig.calibration_temperatures has {len(self.calibration_temperatures)} entries but "
                f"block_size is {self.block_size}; give one temperature per block position (1.0 = uncalibrated)."
            )
        if any(t <= 0 for t in self.calibration_temperatures):
            raise ValueError(f"DSparkConfig.calibration_temperatures={self.calibration_temperatures} must all be > 0.")
        k = self.draft_vocab_size
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.vocab_size):
            raise ValueError(
                f"DSparkConfig.draft_vocab_size={k!r} must be None (full vocabulary) or an integer in "
                f"[1, {self.vocab_size}]; set it together with the ids through `draft.set_draft_vocab(ids)`."
            )
        if self.target_hidden_size != self.hidden_size:
            raise ValueError(
                f"DSparkConfig.hidden_size={self.hidden_size} differs from target_hidden_size="
                f"{self.target_hidden_size}; the draft shares the target's embedding and LM head, so both must match."
            )
        if self.target_vocab_size != self.vocab_size:
            raise ValueError(
                f"DSparkConfig.vocab_size={self.vocab_size} differs from target_vocab_size={self.target_vocab_size}; "
                "the draft shares the target's vocabulary, so both must match."
            )

    def _validate_layers(self) -> None:
        from transformers.activations import ACT2FN

        if self.hidden_act not in ACT2FN:
            raise ValueError(
                f"DSparkConfig.hidden_act={self.hidden_act!r} is not an activation transformers knows; use a key of "
                f"transformers.activations.ACT2FN such as 'silu', 'gelu', 'gelu_pytorch_tanh'."
            )
        if self.layer_style not in LAYER_STYLES:
            raise ValueError(
                f"DSparkConfig.layer_style={self.layer_style!r} is not supported; choose one of {LAYER_STYLES} "
                "('qwen3' for DeepSpec Qwen3 and speculators drafts, 'gemma4' for DeepSpec Gemma4 drafts)."
            )
        if self.attention_k_eq_v and self.layer_style != "gemma4":
            raise ValueError("DSparkConfig.attention_k_eq_v=True needs layer_style='gemma4' (Gemma4 attention).")
        cap = self.final_logit_softcapping
        if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
            raise ValueError(f"DSparkConfig.final_logit_softcapping must be None or > 0, got {cap!r}.")
        types = self.layer_types
        if types is not None and (
            len(types) != self.num_hidden_layers or any(t not in (FULL_ATTENTION, SLIDING_ATTENTION) for t in types)
        ):
            raise ValueError(
                f"DSparkConfig.layer_types={types!r} must give one of {FULL_ATTENTION!r} / {SLIDING_ATTENTION!r} for "
                f"each of the {self.num_hidden_layers} draft layers."
            )
        window = self.sliding_window
        if SLIDING_ATTENTION in (types or ()) and (
            not isinstance(window, int) or isinstance(window, bool) or window < 1
        ):
            raise ValueError(
                f"DSparkConfig.sliding_window={window!r}: layer_types has sliding layers, which need a positive "
                "integer window (the context tokens before the anchor that a sliding layer's block sees)."
            )
        if not isinstance(self.sample_from_anchor, bool):
            raise ValueError(f"DSparkConfig.sample_from_anchor must be true or false, got {self.sample_from_anchor!r}.")
        rope = self.rope_parameters
        rope_type = rope.get("rope_type")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            hint = (
                " It changes the rotary frequencies with the sequence length at run time, which the draft layers do "
                "not reproduce."
                if rope_type in ("dynamic", "longrope")
                else ""
            )
            raise ValueError(
                f"DSparkConfig.rope_parameters has rope_type={rope_type!r}, which DSpark draft layers do not "
                f"support.{hint} Supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
            )
        partial = float(rope.get("partial_rotary_factor", 1.0) or 1.0)
        if partial != 1.0 and rope_type != "proportional":
            raise ValueError(
                f"DSparkConfig.rope_parameters sets partial_rotary_factor={partial} with rope_type={rope_type!r}; "
                "DSpark draft layers rotate the whole head (only the 'proportional' type, Gemma4's, handles a "
                "partial rotary, and does so over the whole head)."
            )

    @property
    def num_target_features(self) -> int:
        """`int`: number of target layers fused into the context features (`m`)."""
        return len(self.target_layer_ids)

    def layer_type(self, index: int) -> str:
        """`str`: the attention type of draft layer `index` (`"full_attention"` or `"sliding_attention"`)."""
        return FULL_ATTENTION if self.layer_types is None else self.layer_types[index]

    @property
    def backbone_slots(self) -> int:
        """`int`: slots per block the backbone runs: `block_size`, or `block_size + 1` in the DFlash layout
        (`sample_from_anchor=False`)."""
        return self.block_size + (0 if self.sample_from_anchor else 1)

    @property
    def uses_markov_feature(self) -> bool:
        """`bool`: whether the confidence head reads the previous token's Markov embedding."""
        return self.confidence_with_markov and self.sequential_head != "none"

    @classmethod
    def from_target(cls, target: Any, **overrides: Any) -> DSparkConfig:
        """Build a config whose shapes and provenance come from a target model (or its config).

        Args:
            target (`PreTrainedModel` or `PreTrainedConfig`): the target causal LM or its config.
            **overrides: any `DSparkConfig` field, e.g. `num_hidden_layers=2, sequential_head="gated"`.

        Returns:
            `DSparkConfig`
        """
        tcfg = getattr(target, "config", target).get_text_config()
        num_heads = tcfg.num_attention_heads
        rope = rope_parameters_of(tcfg)
        gemma4 = str(getattr(tcfg, "model_type", "")).startswith("gemma4")
        shape = (
            _gemma4_fields(tcfg)
            if gemma4
            else {
                "num_key_value_heads": getattr(tcfg, "num_key_value_heads", None) or num_heads,
                "head_dim": getattr(tcfg, "head_dim", None) or tcfg.hidden_size // num_heads,
            }
        )
        fields: dict[str, Any] = {
            "vocab_size": tcfg.vocab_size,
            "hidden_size": tcfg.hidden_size,
            "intermediate_size": tcfg.intermediate_size,
            "num_attention_heads": num_heads,
            **shape,
            "rms_norm_eps": getattr(tcfg, "rms_norm_eps", 1e-6),
            "rope_theta": float(rope["rope_theta"]),
            "rope_parameters": rope,
            "hidden_act": getattr(tcfg, "hidden_act", None) or getattr(tcfg, "hidden_activation", None) or "silu",
            "final_logit_softcapping": getattr(tcfg, "final_logit_softcapping", None),
            "max_position_embeddings": getattr(tcfg, "max_position_embeddings", 32768),
            "target_name_or_path": getattr(tcfg, "name_or_path", None) or None,
            "target_revision": commit_hash(tcfg),
            "target_hidden_size": tcfg.hidden_size,
            "target_vocab_size": tcfg.vocab_size,
            "target_num_hidden_layers": tcfg.num_hidden_layers,
        }
        if "rope_theta" in overrides and "rope_parameters" not in overrides:  # a new base, same rotary type
            fields["rope_parameters"] = {**rope, "rope_theta": float(overrides["rope_theta"])}
        fields.update(overrides)
        return cls(**fields)


def _gemma4_fields(tcfg: Any) -> dict[str, Any]:
    """Shape of DeepSpec's Gemma4 draft layers for a Gemma4 text config (its full-attention layers' shape)."""
    k_eq_v = bool(getattr(tcfg, "attention_k_eq_v", False))
    # transformers >= 5.2x keeps the full-attention shape in `per_layer_config`; earlier versions in
    # `global_head_dim` / `num_global_key_value_heads`.
    full = tcfg.per_layer_config["full_attention"] if hasattr(tcfg, "per_layer_config") else None
    if full is not None:
        head_dim, kv_heads = full.head_dim, full.num_key_value_heads
    else:
        head_dim = tcfg.global_head_dim
        kv_heads = tcfg.num_global_key_value_heads if k_eq_v else tcfg.num_key_value_heads
    return {"layer_style": "gemma4", "attention_k_eq_v": k_eq_v, "head_dim": head_dim, "num_key_value_heads": kv_heads}
