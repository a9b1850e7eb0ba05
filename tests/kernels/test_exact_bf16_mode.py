"""The `"exact-bf16"` kernel mode: the exact (batch-invariant) kernels with every linear on the exact bf16 GEMM.

What the mode promises, checked on tiny float32 targets built here:

* speculative greedy `generate()` (with a draft, its drafting round compiled or eager) is token-identical to plain
  greedy `generate()` in the same mode, and the engine, with several requests decoded together and joining
  mid-generation, with and without a draft, gives each request plain decoding's tokens and its target logits
  bit for bit;
* it really runs bf16: its logits differ from the `"exact"` (float32) mode's, by no more than bf16 rounding can
  explain, and equal a reference that rounds each linear's input and weight to bf16 and sums in float32 and
  attends over keys and values rounded to bf16;
* the engine's KV slots hold bf16, and a padded forward (transformers' modules over the slots) reads and writes
  them with the bits the unpadded one gives;
* it is batch-invariant at the model level: k rows (a batch of prompts, or a prompt's tokens in one forward)
  give bit for bit the logits of each row alone (one prompt alone, or token by token with the cache);
* leaving the mode gives the models back: stock forwards after the block equal those before, no swap is left;
* it is the default for a target held in bfloat16 on the CPU, held in float32 inside the block (the same
  parameter objects) and in bfloat16 again after it, with the engine's requests under concurrency equal to plain
  decoding in the mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from dspark_hf import DSparkEngine, last_generation_stats
from dspark_hf.decoding.compiled import CompiledRound
from dspark_hf.kernels import (
    KERNEL_MODES,
    build,
    is_exact,
    is_exact_bf16,
    is_lean,
    is_lean_model,
    kernels_of,
    lean_bf16,
    use_kernels,
)

from helpers import make_aligned_draft, make_target, randomize, record_committed_logits, run_joining

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(build.backend() is None, reason="the exact kernels could not be compiled here"),
]

VOCAB = 512
MODE = "exact-bf16"


def _target(arch: str = "llama"):
    # fp32 (the exact kernels' dtype), Markov-like so that an aligned draft is often right
    return make_target(arch, vocab_size=VOCAB, hidden_size=128, num_layers=2, markov=True, dtype=torch.float32)


def _prompts(n: int = 5, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 40, 9, 70, 17, 5][:n]
    news = [14, 9, 20, 6, 17, 11][:n]
    return [(torch.randint(0, VOCAB, (length,), generator=gen).tolist(), m) for length, m in zip(lengths, news)]


def _plain(target, prompt, m, mode=MODE):
    out = target.generate(
        torch.tensor([prompt]), max_new_tokens=m, do_sample=False, dspark_kernels=mode,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [logits[0] for logits in out.logits]


def test_the_mode_is_named_and_the_default_only_for_a_bf16_target():
    from dspark_hf.kernels import default_kernels

    assert MODE in KERNEL_MODES
    assert default_kernels(_target()) == "exact"
    assert default_kernels(_target().to(torch.bfloat16)) == MODE


def test_a_bf16_target_runs_the_mode_by_default_and_is_given_back_in_bf16():
    target = _target().to(torch.bfloat16)
    draft = make_aligned_draft(target, block_size=5)
    params = {name: (p, p.detach().clone()) for name, p in [*target.named_parameters(), *draft.named_parameters()]}
    assert all(p.dtype == torch.bfloat16 for p, _ in params.values())
    work = _prompts()
    with use_kernels(target, draft, mode=MODE):
        assert all(p.dtype == torch.float32 for p, _ in params.values())  # held in float32 inside the block
        refs = [_plain(target, prompt, m) for prompt, m in work]
    engine = DSparkEngine(target, draft, policy="fixed", max_batch_size=3)  # kernels unnamed: the default
    assert engine.kernels == MODE
    rows = record_committed_logits(engine)
    ids, outputs = run_joining(engine, work, first=2)
    for rid, (tokens, logits) in zip(ids, refs):
        assert outputs[rid].token_ids == tokens and len(rows[rid]) >= len(logits) - 1
        assert all(torch.equal(a, b) for a, b in zip(rows[rid], logits[1:]))
    # the same parameter objects, bf16 again, every value as it was
    for name, p in [*target.named_parameters(), *draft.named_parameters()]:
        assert p is params[name][0] and p.dtype == torch.bfloat16 and torch.equal(p, params[name][1]), name


@pytest.mark.parametrize("arch,head,compiled", [("llama", "markov", True), ("qwen3", "markov", False)])
def test_speculative_generate_equals_plain_generate_in_the_mode(arch, head, compiled, monkeypatch):
    target = _target(arch)
    draft = make_aligned_draft(target, head=head, block_size=5)
    draft.generation_config.dspark_compiled = compiled
    rounds = {"block": 0}
    original = CompiledRound.block

    def counting(self, *args, **kwargs):
        assert self.bf16  # the compiled drafting round runs the bf16 GEMM too
        rounds["block"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CompiledRound, "block", counting)
    accepted = 0
    for prompt, m in _prompts():
        plain, _ = _plain(target, prompt, m)
        spec = target.generate(
            torch.tensor([prompt]), assistant_model=draft, max_new_tokens=m, do_sample=False,
            dspark_kernels=MODE, dspark_policy="fixed",
        )  # fmt: skip
        assert spec[0, len(prompt) :].tolist() == plain
        accepted += sum(r.accepted for r in last_generation_stats(draft).rounds)
    assert accepted > 0  # drafts were accepted: multi-row verification forwards really ran
    assert (rounds["block"] > 0) == compiled
    assert kernels_of(target) == "stock" and kernels_of(draft) == "stock"


def test_the_compiled_drafting_round_drafts_what_the_eager_one_drafts():
    target = _target("qwen2")
    draft = make_aligned_draft(target, block_size=5)
    randomize(draft, seed=4)
    draft.set_draft_vocab(list(range(0, VOCAB, 2)))  # the subset head rows: a functional linear
    runs = {}
    for compiled in (True, False):
        draft.generation_config.dspark_compiled = compiled
        out = target.generate(
            torch.tensor([[3, 17, 42, 8, 91, 5, 23]]), assistant_model=draft, max_new_tokens=24, do_sample=False,
            dspark_kernels=MODE, dspark_policy="fixed", dspark_lookup=False,
        )  # fmt: skip
        stats = last_generation_stats(draft)
        runs[compiled] = (out, [(r.drafted, r.confidence_logits, r.verified, r.accepted) for r in stats.rounds])
    assert torch.equal(runs[True][0], runs[False][0])
    assert runs[True][1] == runs[False][1]  # bit for bit, confidence logits included


def _engine_run(target, draft, policy: str, work):
    """Every request of `work` through one engine (one joining before every round): tokens and the target's logits
    of each committed row."""
    engine = DSparkEngine(target, draft, policy=policy, max_batch_size=8, kernels=MODE)
    rows = record_committed_logits(engine)
    busiest = 0
    kv_dtypes = set()

    def check(engine):
        nonlocal busiest
        busiest = max(busiest, len(engine._active))
        if engine.has_unfinished():
            assert kernels_of(target) == MODE
        if engine._kv.allocated:
            kv_dtypes.add(engine._kv.buffers(0, 1)[0][0].dtype)

    ids, outputs = run_joining(engine, work, after_step=check)
    assert busiest >= 3  # several requests were decoded together
    assert kv_dtypes == {torch.bfloat16}  # the unpadded forwards kept the target's keys and values in bf16
    assert kernels_of(target) == "stock"  # given back when idle
    return [(outputs[i].token_ids, rows.get(i, [])) for i in ids]


@pytest.mark.parametrize("policy", ["fixed", "none"])
def test_engine_gives_each_request_plain_decoding_in_the_mode(policy):
    target = _target("qwen2")
    draft = make_aligned_draft(target, block_size=5) if policy != "none" else None
    work = _prompts()
    compared = 0
    for (prompt, m), (tokens, rows) in zip(work, _engine_run(target, draft, policy, work)):
        plain, logits = _plain(target, prompt, m)
        assert tokens == plain
        steps = logits[1:]  # step 0 is the prefill's, made outside the rounds
        assert len(rows) >= len(steps)
        assert all(torch.equal(row, step) for row, step in zip(rows, steps))
        compared += len(steps)
    assert compared > 40


def _rounded_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention (the reference's inputs have no padding) over keys and values rounded to bf16, the mode's
    KV precision; torch's SDPA in float32."""
    rep = query.shape[1] // key.shape[1]
    key = key.bfloat16().float().repeat_interleave(rep, dim=1)
    value = value.bfloat16().float().repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _bf16_reference_logits(target, ids):
    """The target's logits with every linear computed as `F.linear` of bf16-rounded input and weight, in float64
    sums, and attention over keys and values rounded to bf16 (everything else as the stock float32 model computes
    it)."""
    from transformers import AttentionInterface

    def rounded(self, x):
        w, b = self.weight.bfloat16().double(), None if self.bias is None else self.bias.double()
        return F.linear(x.bfloat16().double(), w, b).float()

    AttentionInterface.register("test_rounded_kv", _rounded_kv_attention)
    previous = target.config._attn_implementation
    linears = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    try:
        target.set_attn_implementation("test_rounded_kv")
        for m in linears:
            m.forward = rounded.__get__(m)
        with torch.no_grad():
            return target(input_ids=ids).logits
    finally:
        target.set_attn_implementation(previous)
        for m in linears:
            del m.forward


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_mode_runs_bf16_linears(arch):
    target = _target(arch)
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    logits = {}
    for mode in ("exact", MODE):
        with use_kernels(target, mode=mode), torch.no_grad():
            assert kernels_of(target) == mode and is_lean_model(target.model)
            linears = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
            assert linears and all(is_exact(m) and is_exact_bf16(m) == (mode == MODE) for m in linears)
            assert all(lean_bf16(layer) == (mode == MODE) for layer in target.model.layers)
            logits[mode] = target(input_ids=ids).logits
    diff = (logits[MODE] - logits["exact"]).abs()
    scale = logits["exact"].abs().max()
    assert diff.max() > 0  # not the float32 mode
    assert diff.max() < 0.05 * scale  # but within what bf16 rounding (2^-8 relative per linear) explains
    # a reference with the same bf16 roundings (float64 sums) is far closer to the mode than the float32 mode is
    # (on average: a sum that lands on the other side of a bf16 rounding boundary in a later linear moves a few
    # elements by one bf16 step)
    reference = (logits[MODE] - _bf16_reference_logits(target, ids)).abs()
    assert reference.mean() < 0.05 * diff.mean()
    assert (reference < 1e-4).float().mean() > 0.85  # measured: 0.90 (llama), 0.99 (qwen3); fp32 mode: 0.006


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_k_rows_equal_each_row_alone_bit_for_bit(arch):
    target = _target(arch)
    ids = torch.randint(0, VOCAB, (5, 24), generator=torch.Generator().manual_seed(2))
    with use_kernels(target, mode=MODE):
        batch = target(input_ids=ids).logits
        for i in range(ids.shape[0]):  # a batch of k prompts: each row as alone
            assert torch.equal(batch[i : i + 1], target(input_ids=ids[i : i + 1]).logits)
        cache = DynamicCache(config=target.config)  # a prompt's k tokens in one forward: as token by token
        one_by_one = [target(input_ids=ids[:1, t : t + 1], cache=cache, use_cache=True).logits for t in range(24)]
        assert torch.equal(batch[:1], torch.cat(one_by_one, dim=1))
        cache = DynamicCache(config=target.config)  # 1-row and k-row verification forwards over a cache
        target(input_ids=ids[:1, :10], cache=cache, use_cache=True)
        block = target(input_ids=ids[:1, 10:16], cache=cache, use_cache=True).logits
        assert torch.equal(block, batch[:1, 10:16])


@torch.no_grad()
def test_leaving_the_mode_restores_the_models():
    target = _target("qwen3")
    draft = make_aligned_draft(target, block_size=5)
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(4))
    before = target(input_ids=ids).logits
    forwards = {name: dict(m.__dict__) for name, m in target.named_modules()}
    with use_kernels(target, draft, mode=MODE):
        assert kernels_of(target) == MODE and kernels_of(draft) == MODE
        assert all(is_lean(layer) for layer in [*target.model.layers, *draft.layers])
        target(input_ids=ids)
    assert kernels_of(target) == "stock" and kernels_of(draft) == "stock"
    assert not any(is_lean(layer) for layer in [*target.model.layers, *draft.layers])
    assert not any(is_exact(m) for m in [*target.modules(), *draft.modules()])
    assert {name: set(m.__dict__) for name, m in target.named_modules()} == {
        name: set(d) for name, d in forwards.items()
    }
    assert torch.equal(target(input_ids=ids).logits, before)


@torch.no_grad()
def test_the_padded_forward_over_bf16_slots_gives_the_unpadded_forward_bits():
    # the engine keeps an exact-bf16 target's KV slots in bf16 (the unpadded path); when a step falls back to the
    # padded one (transformers' modules over the same slots) it must write and read them with the same bits
    from dspark_hf.decoding.caches import SlotKV
    from dspark_hf.decoding.target_forward import slot_target_forward, varlen_target_forward
    from dspark_hf.kernels.lean_model import varlen_stack

    target = _target("llama")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 23)]
    steps = [[[5], [7]], [[11], [13]]]
    logits = {}
    with use_kernels(target, mode=MODE):
        stack = varlen_stack(target, None)
        assert stack is not None
        for path in ("varlen", "padded"):
            store = SlotKV(2)
            for i in range(2):
                store.add(i)
            out = varlen_target_forward(target, stack, store, [0, 1], prompts, [[len(p) - 1] for p in prompts])
            for slot, p in enumerate(prompts):
                store.lengths[slot] += len(p)
            assert store.buffers(0, 2)[0][0].dtype == torch.bfloat16
            seen = [out.logits]
            for step in steps:
                if path == "varlen":
                    out = varlen_target_forward(target, stack, store, [0, 1], step, [[0], [0]])
                else:
                    out = slot_target_forward(target, store, step, [[0], [0]])
                for slot in range(2):
                    store.lengths[slot] += 1
                seen.append(out.logits)
            logits[path] = (seen, [t.clone() for kv in store.buffers(0, 2) for t in kv])
    (a, kv_a), (b, kv_b) = logits["varlen"], logits["padded"]
    assert all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))
    used = [len(p) + len(steps) for p in prompts]
    for x, y in zip(kv_a, kv_b):  # the same keys and values written, bit for bit
        assert all(torch.equal(x[r, :, :n], y[r, :, :n]) for r, n in enumerate(used))
