"""Tiny in-process targets and drafts for the tests (nothing is downloaded).

`make_target` builds a random Llama / Qwen2 / Qwen3 causal LM. With `markov=True` its attention and MLP
outputs are scaled down (by `context_scale`), so the next token depends mostly on the current token: the
target is close to a first-order Markov chain `T[x] = lm_head(norm(embed(x)))`, but still reads its
context (and so still exercises the KV cache and its rollback).

`make_aligned_draft` builds a DSpark draft whose sequential head reproduces that transition table exactly
(the backbone's base logits are switched off by a zero final norm), so the draft is *mostly right* and
the accept path of speculative decoding is really exercised (τ well above 1).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

import dspark_hf  # noqa: F401  (registers the generate() hook)
from dspark_hf import DSparkDraftModel

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def make_target(
    arch: str = "llama",
    vocab_size: int = 96,
    hidden_size: int = 32,
    num_layers: int = 6,
    seed: int = 0,
    markov: bool = False,
    context_scale: float = 0.05,
    logit_scale: float = 1.0,
    dtype: torch.dtype = torch.float64,
    **config_overrides,
):
    """A tiny random causal LM; fp64 by default so batched and step-wise forwards agree to ~1e-15.

    `config_overrides` go to the config class (e.g. `rope_parameters=...`, `hidden_act="gelu"`).
    """
    torch.manual_seed(seed)
    config_cls, model_cls = ARCHS[arch]
    extra = {"head_dim": hidden_size // 4} if arch == "qwen3" else {}
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **{**extra, **config_overrides},
    )
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # wider init than the default 0.02, so the random model is not flat
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
        model.lm_head.weight.mul_(logit_scale)
        if markov:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(context_scale / 10)
                layer.mlp.down_proj.weight.mul_(context_scale / 10)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.to(dtype)


def transition_table(target) -> torch.Tensor:
    """`T[x] = lm_head(norm(embed(x)))`: the target's next-token logits if it ignored its context."""
    with torch.no_grad():
        emb = target.get_input_embeddings().weight
        return target.model.norm(emb) @ target.lm_head.weight.T


def make_aligned_draft(target, head: str = "markov", block_size: int = 5, num_layers: int = 1, seed: int = 1):
    """A draft whose proposals follow the target's transition table `T` (see module docstring)."""
    torch.manual_seed(seed)
    d = target.config.hidden_size
    draft = DSparkDraftModel.from_target(
        target, sequential_head=head, markov_rank=d, num_hidden_layers=num_layers, block_size=block_size
    ).eval()
    if head == "none":  # no sequential head to align: a plain random DFlash-style draft
        return draft
    with torch.no_grad():
        normed = target.model.norm(target.get_input_embeddings().weight)  # [V, d]
        draft.norm.weight.zero_()  # base logits U = 0: the sequential head carries the prediction
        mh = draft.markov_head
        if head in ("markov", "gated"):
            mh.markov_w1.weight.copy_(normed)
            mh.markov_w2.weight.copy_(target.lm_head.weight)
        if head == "gated":  # gate ≈ 1
            mh.gate_proj.weight.zero_()
            mh.gate_proj.bias.fill_(30.0)
        if head == "rnn":  # output o = 0.01·W1[x] and tanh(o)/0.01 ≈ W1[x]
            small = 0.01
            mh.markov_w1.weight.copy_(normed)
            mh.markov_w2.weight.copy_(target.lm_head.weight / small)
            mh.joint_proj.weight.zero_()
            mh.joint_proj.bias.zero_()
            r = mh.rank
            mh.joint_proj.weight[2 * r : 3 * r, r : 2 * r] = small * torch.eye(r, dtype=normed.dtype)
        if draft.confidence_head is not None:  # varied confidences, so threshold policies vary the length
            draft.confidence_head.proj.weight.normal_(0.0, 1.0)
            draft.confidence_head.proj.bias.fill_(1.0)
    return draft
