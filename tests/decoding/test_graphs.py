"""The draft step at static shapes (`dspark_hf.decoding.draft_graphs`) and the `cuda_graphs` option.

On the CPU: the padded step (context padded to a capacity bucket, a visibility mask, noise as an input) gives
the eager path's tokens, logits and scores for every head, greedy and sampling, with and without a draft
vocabulary subset; it traces with `torch.compile(fullgraph=True)`; the runner that feeds it (static buffers,
buckets, the store mirror) drives `generate()` to the same output; asking for CUDA graphs on a CPU falls back
with one logged reason. The real capture runs only where CUDA is available.

The drafts are the aligned ones of `helpers.py` with their final norm switched back on, so the backbone (and
with it the padded context and its mask) really shapes the logits.
"""

from __future__ import annotations

import functools
import logging
import types

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from dspark_hf import last_generation_stats
from dspark_hf.decoding import draft_graphs, drafting
from dspark_hf.decoding.caches import KVStore
from sync_counter import SyncCounter

from helpers import make_aligned_draft, make_target

VOCAB = 96
GAMMA = 4
SUBSET = list(range(0, VOCAB, 2))
LOGGER = "dspark_hf.decoding.draft_graphs"


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB, markov=True)


def _draft(target, head="markov", subset=False, gamma=GAMMA):
    draft = make_aligned_draft(target, head, block_size=gamma)
    with torch.no_grad():  # base logits matter (drawn on the CPU, so a CUDA draft gets the same weights)
        weight = draft.norm.weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(5), dtype=weight.dtype))
    if subset:
        draft.set_draft_vocab(SUBSET)
    return draft.bind_target(target)


def _stores(draft, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    stores = [KVStore(512) for _ in lengths]
    feats = [torch.randn(n, draft.fc.in_features, generator=gen, dtype=draft.dtype) for n in lengths]
    drafting.ingest(draft, stores, feats)
    return stores


def _noise(rows, seed=1):
    return torch.empty(rows, GAMMA, VOCAB, dtype=torch.float64).exponential_(
        generator=torch.Generator().manual_seed(seed)
    )


def _eager(draft, stores, anchors, do_sample, noise, processors=None):
    hidden, base = drafting.draft_block(draft, stores, anchors)
    sampler = drafting.SharedSampler(processors, anchors[:, None], do_sample, noise=noise)
    block = drafting.sample_block(draft, hidden, base, anchors, sampler, guessed_path=False)
    return block, drafting.score_block(block, torch.tensor(draft.config.calibration_temperatures))


def _padded_inputs(draft, stores, capacity=64, extra=0):
    """A padded context filled by hand (padding holds random finite values: it must be masked), lengths and
    temperatures."""
    gen = torch.Generator().manual_seed(9)
    context = []
    for i in range(len(draft.layers)):
        pair = []
        for kv in (0, 1):
            first = stores[0].layer(i)[kv]
            shape = (len(stores), first.shape[0], capacity, first.shape[2])
            buf = torch.randn(shape, generator=gen, dtype=first.dtype)
            for r, s in enumerate(stores):
                buf[r, :, : len(s)] = s.layer(i)[kv]
            pair.append(buf)
        context.append(tuple(pair))
    lengths = torch.tensor([len(s) + extra for s in stores])
    return context, lengths, torch.tensor(draft.config.calibration_temperatures)


def _padded(draft, stores, anchors, do_sample, noise, processors=None, extra=0):
    context, lengths, temps = _padded_inputs(draft, stores, extra=extra)
    return draft_graphs.padded_draft_step(draft, context, lengths, anchors, temps, processors, do_sample, noise)


def _assert_same(eager, padded):
    (eb, es), (pb, ps) = eager, padded
    assert torch.equal(eb.tokens, pb.tokens)
    torch.testing.assert_close(eb.logits, pb.logits)  # -inf where excluded, in the same places
    if eb.confidence_logits is None:
        assert pb.confidence_logits is None
    else:
        torch.testing.assert_close(eb.confidence_logits, pb.confidence_logits)
    for name in ("confidence", "calibrated", "survival"):
        torch.testing.assert_close(getattr(es, name), getattr(ps, name))


# ---------------------------------------------------------------------- the padded step equals the eager one
@pytest.mark.parametrize("subset", [False, True], ids=["full", "subset"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("head", ["markov", "gated", "rnn", "none"])
def test_padded_step_equals_eager(target, head, do_sample, subset):
    draft = _draft(target, head, subset)
    for lengths, anchors in (([13], [5]), ([13, 7, 30], [3, 8, 41])):  # one row; ragged rows
        stores = _stores(draft, lengths)
        anchors = torch.tensor(anchors)
        noise = _noise(len(lengths)) if do_sample else None
        eager = _eager(draft, stores, anchors, do_sample, noise)
        _assert_same(eager, _padded(draft, stores, anchors, do_sample, noise))
        if subset:
            assert set(eager[0].tokens.flatten().tolist()) <= set(SUBSET)


def test_padded_step_with_graph_safe_processors(target):
    draft = _draft(target, "markov", subset=True)
    stores = _stores(draft, [11, 20])
    anchors = torch.tensor([2, 9])
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    noise = _noise(2)
    eager = _eager(draft, stores, anchors, True, noise, processors)
    _assert_same(eager, _padded(draft, stores, anchors, True, noise, processors))
    assert (torch.isfinite(eager[0].logits).sum(-1) <= 5).all()  # top-k really ran


def test_padded_comparison_has_power(target):
    """Negative control: letting the step see 3 padding positions per row changes its logits."""
    draft = _draft(target, "markov")
    stores = _stores(draft, [13, 7])
    anchors = torch.tensor([3, 8])
    eager = _eager(draft, stores, anchors, False, None)
    with pytest.raises(AssertionError):
        _assert_same(eager, _padded(draft, stores, anchors, False, None, extra=3))


def _compile_cases():
    """Every head × greedy/sampling × subset (slow: ~1.5 s each); the shipped drafts' setting always runs."""
    for head in ("markov", "gated", "rnn"):
        for do_sample in (False, True):
            for subset in (False, True):
                case = f"{head}-{'sampling' if do_sample else 'greedy'}-{'subset' if subset else 'full'}"
                fast = (head, do_sample, subset) == ("markov", True, True)
                yield pytest.param(head, do_sample, subset, id=case, marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize(("head", "do_sample", "subset"), list(_compile_cases()))
def test_padded_step_compiles_without_graph_breaks(target, head, do_sample, subset):
    torch._dynamo.reset()
    draft = _draft(target, head, subset)
    stores = _stores(draft, [13, 7])
    anchors = torch.tensor([3, 8])
    noise = _noise(2) if do_sample else None
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(10)]) if do_sample else None
    context, lengths, temps = _padded_inputs(draft, stores)
    args = (context, lengths, anchors, temps, processors, do_sample, noise)
    eager = draft_graphs.padded_draft_step(draft, *args)
    compiled = torch.compile(functools.partial(draft_graphs.padded_draft_step, draft), fullgraph=True, backend="eager")
    _assert_same(eager, compiled(*args))


# ---------------------------------------------------------------------- the runner: buffers, buckets, mirror
def test_buckets():
    capacities = {0: 64, 1: 64, 64: 64, 65: 128, 128: 128, 129: 256, 1000: 1024}
    assert {n: draft_graphs.capacity_bucket(n) for n in capacities} == capacities
    assert [draft_graphs.rows_bucket(r) for r in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_runner_follows_growing_stores_across_buckets(target, do_sample):
    """Rounds of a growing context (crossing the 64- and 128-token buckets), 3 rows padded to 4, a row whose
    store is replaced: every round equals the eager path on the same noise."""
    draft = _draft(target, "rnn", subset=True)
    draft_graphs.clear_graph_cache(draft)
    runner = draft_graphs.DraftStepGraphs(draft, None, do_sample, capture=False)
    stores = _stores(draft, [50, 10, 60])
    gen = torch.Generator().manual_seed(3)
    for round_ in range(6):
        anchors = torch.tensor([1 + round_, 7, 30])
        seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        graphed = runner.run(stores, anchors, torch.Generator().manual_seed(seed) if do_sample else None)
        noise = _noise(4, seed)[:3] if do_sample else None  # what the runner drew for its 4 padded rows
        _assert_same(_eager(draft, stores, anchors, do_sample, noise), graphed)
        growth = [9, 40, 11]
        if round_ == 3:
            stores[1] = _stores(draft, [5], seed=7)[0]  # a new request in row 1
        new = _stores(draft, growth, seed=10 + round_)
        for store, extra in zip(stores, new):  # commit `growth` more tokens to every row
            store.append([extra.layer(i) for i in range(len(draft.layers))])
    capacities = sorted(key[2] for key in draft_graphs.graph_cache(draft).entries)
    assert capacities == [64, 128, 256], capacities
    assert all(key[1] == 4 for key in draft_graphs.graph_cache(draft).entries)


def test_cache_is_bounded_and_dropped_when_weights_change(target):
    draft = _draft(target, "markov")
    draft_graphs.clear_graph_cache(draft)
    runner = draft_graphs.DraftStepGraphs(draft, None, False, capture=False)
    cache = draft_graphs.graph_cache(draft)
    cache.max_entries = 2
    for n in (10, 100, 200, 300):
        runner.run(_stores(draft, [n]), torch.tensor([1]))
    assert [key[2] for key in cache.entries] == [256, 512]
    with torch.no_grad():
        draft.fc.weight.mul_(1.0)  # an in-place update: captured graphs would read stale rows
    draft_graphs.DraftStepGraphs(draft, None, False, capture=False)
    assert not cache.entries
    import copy

    assert not draft_graphs.graph_cache(copy.deepcopy(draft)).entries  # a copy never shares captured graphs


# ---------------------------------------------------------------------- the option in generate()
def _prompt(seed=0, length=10):
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _graph_warnings(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("how", ["kwarg", "config", "draft default"])
def test_requested_on_cpu_falls_back_once_with_the_reason(target, how, caplog):
    draft = _draft(target, "markov", subset=True)
    kwargs = {"max_new_tokens": 30, "do_sample": False}
    expected = target.generate(_prompt(), **kwargs)
    if how == "kwarg":
        kwargs["dspark_cuda_graphs"] = True
    elif how == "config":
        kwargs = {"generation_config": GenerationConfig(dspark_cuda_graphs=True, **kwargs)}
    else:
        draft.generation_config.dspark_cuda_graphs = True
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = target.generate(_prompt(), assistant_model=draft, dspark_policy="fixed", **kwargs)
    assert torch.equal(out, expected)
    warnings = _graph_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "the draft is on cpu" in warnings[0].getMessage()
    stats = last_generation_stats(draft)
    assert stats.cuda_graphs is False and "cpu" in stats.cuda_graphs_fallback
    assert stats.num_rounds > 3
    assert not hasattr(draft, "_call_cuda_graphs")  # nothing of the call is parked on the draft


def test_default_is_off_on_cpu_and_silent(target, caplog):
    draft = _draft(target, "markov")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        target.generate(_prompt(), assistant_model=draft, max_new_tokens=12, do_sample=False)
    assert not [r for r in caplog.records if r.name == LOGGER]
    stats = last_generation_stats(draft)
    assert stats.cuda_graphs is False and stats.cuda_graphs_fallback is None
    assert stats.summary()["cuda_graphs"] is False


def test_option_values_are_checked(target):
    draft = _draft(target, "markov")
    with pytest.raises(ValueError, match=r"dspark_cuda_graphs must be True or False"):
        target.generate(_prompt(), assistant_model=draft, max_new_tokens=4, dspark_cuda_graphs="yes")
    with pytest.raises(ValueError, match="only applies with"):
        target.generate(_prompt(), max_new_tokens=4, dspark_cuda_graphs=True)
    draft.generation_config.dspark_cuda_graphs = True
    # the call's own value wins over the draft attribute: False is silent and eager
    target.generate(_prompt(), assistant_model=draft, max_new_tokens=4, dspark_cuda_graphs=False)
    assert last_generation_stats(draft).cuda_graphs_fallback is None


def test_processors_outside_the_graph_safe_set_are_named(monkeypatch):
    cuda_draft = types.SimpleNamespace(device=torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    safe = [TemperatureLogitsWarper(0.5), TopKLogitsWarper(4)]
    assert draft_graphs.graph_unavailable(cuda_draft, safe) is None
    reason = draft_graphs.graph_unavailable(cuda_draft, [*safe, RepetitionPenaltyLogitsProcessor(1.2)])
    assert "RepetitionPenaltyLogitsProcessor" in reason


@pytest.fixture
def graph_path_on_cpu(monkeypatch):
    """The graph path with its capture replaced by eager runs of the same padded step (static buffers and all);
    a test asks for it with the draft's `dspark_cuda_graphs` default (off on a CPU otherwise)."""
    monkeypatch.setattr(draft_graphs, "graph_unavailable", lambda draft, processors: None)
    monkeypatch.setattr(draft_graphs, "DraftStepGraphs", functools.partial(draft_graphs.DraftStepGraphs, capture=False))


@pytest.mark.parametrize("head", ["markov", "rnn", "none"])
def test_graph_path_drives_generate_to_the_same_greedy_output(target, head, graph_path_on_cpu):
    draft = _draft(target, head, subset=head == "markov")
    draft.generation_config.dspark_cuda_graphs = True
    for seed, length, max_new in ((0, 10, 40), (1, 70, 30), (2, 3, 9)):  # crossing the 64/128 buckets
        prompt = _prompt(seed, length)
        expected = target.generate(prompt, max_new_tokens=max_new, do_sample=False)
        out = target.generate(prompt, assistant_model=draft, max_new_tokens=max_new, do_sample=False)
        assert torch.equal(out, expected), (head, seed)
        assert last_generation_stats(draft).cuda_graphs is True


def test_graph_path_sampling_is_reproducible(target, graph_path_on_cpu):
    draft = _draft(target, "markov", subset=True)
    draft.generation_config.dspark_cuda_graphs = True
    outs = []
    for _ in range(2):
        torch.manual_seed(4)
        outs.append(target.generate(_prompt(), assistant_model=draft, max_new_tokens=30, do_sample=True, top_k=20))
        assert last_generation_stats(draft).cuda_graphs is True
    assert torch.equal(outs[0], outs[1])


def test_graph_path_reads_the_device_once_per_round(target, graph_path_on_cpu):
    """Mirroring the store and filling the static buffers add no host read: the round's one packed copy stays."""
    draft = _draft(target, "markov", subset=True)
    draft.generation_config.dspark_cuda_graphs = True
    with SyncCounter() as counter:
        target.generate(_prompt(), assistant_model=draft, dspark_policy="fixed", max_new_tokens=40, do_sample=True)
    rounds = sum(1 for r in last_generation_stats(draft).rounds if r.drafted)
    assert last_generation_stats(draft).cuda_graphs is True and rounds >= 5
    # one-off: the generator's seed and the temperatures of generate() (2), and each bucket's temperatures
    buckets = len(draft_graphs.graph_cache(draft).entries)
    assert rounds <= counter.total <= rounds + 2 + buckets, counter.by_site


# ---------------------------------------------------------------------- the real capture (CUDA only)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_cuda_graph_capture_replays_the_padded_step(do_sample):
    gpu_target = make_target("llama", vocab_size=VOCAB, markov=True).cuda()
    draft = _draft(gpu_target, "markov", subset=True).cuda()
    stores = _stores(draft, [13])
    anchors = torch.tensor([5], device="cuda")
    processors = LogitsProcessorList([TopKLogitsWarper(8)]) if do_sample else None
    captured = draft_graphs.DraftStepGraphs(draft, processors, do_sample)
    eager = draft_graphs.DraftStepGraphs(draft, processors, do_sample, capture=False)
    for round_ in range(3):
        seed = 100 + round_
        gens = [torch.Generator(device="cuda").manual_seed(seed) for _ in range(2)]
        graphed = captured.run(stores, anchors, gens[0])
        assert graphed is not None, draft_graphs.graph_cache(draft).failed  # the capture raised
        reference = eager.run(stores, anchors, gens[1])
        _assert_same(reference, graphed)  # the same kernels on the same inputs
        new = _stores(draft, [40], seed=round_)[0]  # 13, 53, 93: the second bucket is captured too
        stores[0].append([new.layer(i) for i in range(len(draft.layers))])
    graphs = [key[2] for key, entry in draft_graphs.graph_cache(draft).entries.items() if entry.graph is not None]
    assert sorted(graphs) == [64, 128], graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_in_generate_keep_greedy_identity():
    gpu_target = make_target("llama", vocab_size=VOCAB, markov=True).cuda()  # fp64: no near-tie flips
    draft = _draft(gpu_target, "markov", subset=True).cuda()
    prompt = _prompt().cuda()
    expected = gpu_target.generate(prompt, max_new_tokens=40, do_sample=False)
    kwargs = {"assistant_model": draft, "dspark_policy": "fixed", "max_new_tokens": 40, "do_sample": False}
    for _ in range(2):  # the second call replays the graphs the first one captured
        out = gpu_target.generate(prompt, **kwargs)
        assert torch.equal(out, expected)
        stats = last_generation_stats(draft)
        assert stats.cuda_graphs is True, stats.cuda_graphs_fallback  # auto: on for CUDA
    captured = len(draft_graphs.graph_cache(draft).entries)
    gpu_target.generate(prompt, **kwargs)
    assert len(draft_graphs.graph_cache(draft).entries) == captured
    gpu_target.generate(prompt, **kwargs, dspark_cuda_graphs=False)
    assert last_generation_stats(draft).cuda_graphs is False
    torch.manual_seed(0)  # sampling with top-k (graph-safe): exact draws, and a seed reproduces the call
    first = gpu_target.generate(prompt, **{**kwargs, "do_sample": True}, top_k=20)
    assert last_generation_stats(draft).cuda_graphs is True
    torch.manual_seed(0)
    assert torch.equal(gpu_target.generate(prompt, **{**kwargs, "do_sample": True}, top_k=20), first)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_graphs_keep_greedy_identity():
    """The engine's real capture on a GPU: greedy rows draft through replayed graphs and every output equals
    plain `generate()` (fp64 target: no near-tie flips); sampling rows run the eager step."""
    from dspark_hf import DSparkEngine, SamplingParams

    gpu_target = make_target("llama", vocab_size=VOCAB, markov=True).cuda()
    draft = make_aligned_draft(gpu_target, "markov", block_size=GAMMA).cuda()
    engine = DSparkEngine(gpu_target, draft, policy="fixed", max_batch_size=3)
    assert engine.graphs is not None  # auto: on for a CUDA draft
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 14, 7)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    assert engine.graph_rounds > 0
    for prompt, out in zip(prompts, outs):
        ref = gpu_target.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, do_sample=False)
        assert out.token_ids == ref[0, len(prompt) :].tolist()
    before = engine.graph_rounds
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=6, do_sample=True, seed=1))
    assert engine.graph_rounds == before


# ---------------------------------------------------------------------- the engine's graph path
def test_engine_graph_path_is_exact_and_runs_for_greedy_rows(monkeypatch):
    """`DSparkEngine(cuda_graphs=True)` drafts greedy rows through the graph runner (here replaying the padded
    step eagerly, as on a CPU the capture cannot run) and stays token-identical to plain `generate()`; rows
    that sample fall back to the eager step."""
    from dspark_hf import DSparkEngine, SamplingParams

    monkeypatch.setattr(draft_graphs, "graph_unavailable", lambda draft, processors: None)
    monkeypatch.setattr(draft_graphs, "DraftStepGraphs", functools.partial(draft_graphs.DraftStepGraphs, capture=False))
    target = make_target("llama", vocab_size=VOCAB, markov=True)
    draft = make_aligned_draft(target, "markov", block_size=GAMMA)
    engine = DSparkEngine(target, draft, policy="fixed", max_batch_size=3, cuda_graphs=True)
    assert engine.graphs is not None
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 14, 7)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    assert engine.graph_rounds > 0
    for prompt, out in zip(prompts, outs):
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
        assert out.token_ids == ref.tolist()
    before = engine.graph_rounds
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=6, do_sample=True, seed=1))
    assert engine.graph_rounds == before  # sampling rows run the eager step


def test_engine_cuda_graphs_default_off_on_cpu():
    from dspark_hf import DSparkEngine

    target = make_target("llama", vocab_size=VOCAB, markov=True)
    draft = make_aligned_draft(target, "markov", block_size=GAMMA)
    assert DSparkEngine(target, draft, policy="fixed").graphs is None


def test_engine_cuda_graphs_on_cpu_logs_why_and_runs_eagerly(caplog):
    from dspark_hf import DSparkEngine, SamplingParams

    target = make_target("llama", vocab_size=VOCAB, markov=True)
    draft = make_aligned_draft(target, "markov", block_size=GAMMA)
    with caplog.at_level(logging.WARNING, logger="dspark_hf.decoding.engine"):
        engine = DSparkEngine(target, draft, policy="fixed", cuda_graphs=True)
    assert engine.graphs is None
    assert [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage() and "cpu" in r.getMessage()]
    prompt = [3, 5, 7, 11]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=8))[0]
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
    assert out.token_ids == ref.tolist() and engine.graph_rounds == 0
