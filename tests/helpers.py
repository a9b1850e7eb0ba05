"""Tiny in-process targets and drafts for the tests (nothing is downloaded).

`make_target` builds a random Llama / Qwen2 / Qwen3 causal LM. With `markov=True` its attention and MLP
outputs are scaled down (by `context_scale`), so the next token depends mostly on the current token: the
target is close to a first-order Markov chain `T[x] = lm_head(norm(embed(x)))`, but still reads its
context (and so still exercises the KV cache and its rollback).

`make_aligned_draft` builds a DSpark draft whose sequential head reproduces that transition table exactly
(the backbone's base logits are switched off by a zero final norm), so the draft is *mostly right* and
the accept path of speculative decoding is really exercised (τ well above 1).

For the import/export tests (`test_formats.py`, `test_speculators.py`): `make_gemma4_target`, `randomize`
and `assert_export_round_trip` (exact reload, and DeepSpec's reference forward within `REFERENCE_TOL`).
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import dspark_hf  # noqa: F401  (registers the generate() hook)
from dspark_hf import DSparkDraftModel

from deepspec_reference import block_inputs, max_diff, ours, reference_forward

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
REFERENCE_TOL = 1e-5  # fp32: our draft's forward against DeepSpec's (tests/deepspec_reference.py)
LLAMA3 = {  # llama3 rotary scaling, for targets (`make_target(..., rope_parameters=LLAMA3)`)
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
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
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **{"max_position_embeddings": 512, **extra, **config_overrides},
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


def make_gemma4_target(k_eq_v: bool = True, seed: int = 0, dtype=torch.float32):
    """A tiny random Gemma4 causal LM: sliding and full attention layers, a wider full-attention head."""
    torch.manual_seed(seed)
    config = Gemma4TextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=96,
        sliding_window=8,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        final_logit_softcapping=30.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.to(dtype)


def randomize(draft, seed: int = 3):
    """Non-trivial weights everywhere (norms away from 1), so every parameter shows in the logits."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return draft.eval()


def assert_export_round_trip(draft, loaded, folder, tol: float = REFERENCE_TOL) -> None:
    """`loaded` (read back from the export in `folder`) computes exactly what `draft` does, on one random block,
    and DeepSpec's reference forward on `folder` the same within `tol`."""
    inputs = block_inputs(draft)
    for a, b in zip(ours(draft, *inputs), ours(loaded, *inputs)):
        assert max_diff(a, b) == 0.0
    for a, b in zip(ours(draft, *inputs), reference_forward(folder, *inputs)):
        assert max_diff(a, b) <= tol


def record_draft_context(draft) -> list:
    """Wrap `draft.extend_context` so that every `(context, positions)` it ingests is appended to the returned list."""
    seen = []
    original = draft.extend_context

    def recording(cache, context, positions):
        seen.append((context, positions))
        return original(cache, context, positions)

    draft.extend_context = recording
    return seen


def assert_context_is_the_targets(target, draft, seen, out) -> None:
    """The draft ingested exactly the target's features of the committed tokens of `out`, in order and once each."""
    positions = torch.cat([p for _, p in seen], dim=-1)[0]
    context = torch.cat([c for c, _ in seen], dim=1)
    assert positions.tolist() == list(range(positions.numel()))
    assert positions.numel() <= out.shape[1] - 1
    with torch.no_grad():
        full = target(out[:, : positions.numel()], output_hidden_states=True)
        expected = draft.project_context([full.hidden_states[i + 1] for i in draft.config.target_layer_ids])
    torch.testing.assert_close(context, expected, atol=1e-9, rtol=1e-9)


def sampled_workload_with_distractors(
    prompt: list[int], n: int, max_new_tokens: int, vocab: int, seed: int, every: int = 4
):
    """Engine requests for a sampling test: `n` scored requests of `prompt` (sampling, `max_new_tokens`), and every
    `every`-th request a distractor with another prompt (3 to 12 random tokens) and another `max_new_tokens` (2 to
    8), so that batches are ragged. Returns `(prompts, sampling_params, indices of the scored requests)`."""
    from dspark_hf import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompts, params, scored = [], [], []
    while len(scored) < n:
        if len(prompts) % every == every - 1:
            length = int(torch.randint(3, 13, (1,), generator=gen))
            prompts.append(torch.randint(0, vocab, (length,), generator=gen).tolist())
            params.append(SamplingParams(max_new_tokens=int(torch.randint(2, 9, (1,), generator=gen)), do_sample=True))
        else:
            scored.append(len(prompts))
            prompts.append(list(prompt))
            params.append(SamplingParams(max_new_tokens=max_new_tokens, do_sample=True))
    return prompts, params, scored


def record_committed_logits(engine) -> dict:
    """Wrap `engine._accept` to record, per request id, the target's logits of every committed row of a round (the
    anchor's and the accepted drafts': what plain decoding computes); returns the dict it fills."""
    rows: dict[int, list[torch.Tensor]] = {}
    accept = engine._accept

    def recording(reqs, block, drafted, lengths, target_logits, **kwargs):
        outcomes = accept(reqs, block, drafted, lengths, target_logits, **kwargs)
        for i, req in enumerate(reqs):
            rows.setdefault(req.rid, []).extend(target_logits[i][: outcomes[i][0] + 1].clone().unbind(0))
        return outcomes

    engine._accept = recording
    return rows


def run_joining(engine, work, first: int = 0, after_step=None) -> tuple[list[int], dict]:
    """Submit the first `first` requests of `work` (`(prompt, max_new_tokens)` pairs), then one more before every
    round, until every request has finished; `after_step(engine)` runs after every round. Returns the request ids
    in submission order and the finished outputs by id."""
    from dspark_hf import SamplingParams

    pending, ids, outputs = list(work), [], {}
    for prompt, m in pending[:first]:
        ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=m)))
    pending = pending[first:]
    while engine.has_unfinished() or pending:
        if pending:
            prompt, m = pending.pop(0)
            ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=m)))
        for ev in engine.step():
            if ev.finished:
                outputs[ev.request_id] = ev.output
        if after_step is not None:
            after_step(engine)
    return ids, outputs
