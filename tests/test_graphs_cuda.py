"""Decode CUDA graphs on a GPU (skipped without CUDA): graph replay against eager, bitwise.

- At batch 1, 8 and 64 (exact buckets: the eager step runs the very same shapes and kernels), greedy over 64 tokens,
  the graph engine's logits equal the eager (`enforce_eager`) engine's bit for bit, so the tokens are equal too.
- At batch 5 (padded to bucket 8) the replayed graph equals the same padded step run eagerly, bitwise.
- A decode step (inputs, block-table flush, model) makes no host synchronization (`torch.cuda.set_sync_debug_mode`).
- The graphs were really replayed, and captured with no Triton compile left for the serving path, also for a burst
  of prompts prefilled in chunks beside decodes; the sampler's kernels are all compiled at start-up
  (`Sampler.warm_up`): the first top-p batch compiles none.
- Async scheduling (each decode step launched before the previous step's ids are read, its input ids gathered on the
  device): at batch 1, 8 and 64 the same logits bit for bit and the same tokens as with it off, greedy; seeded top-p
  sampling with requests ending at different steps (max_tokens, a stop token) gives the same tokens; a steady async
  step makes no host sync but the one wait for the previous step's ids (a CUDA event).
Run on the GPU machine: `python -m pytest -q tests/test_graphs_cuda.py` (add `-k k3` / `-k linear` to split,
`-k async` for the async scheduling checks).
"""

from __future__ import annotations

import pytest
import torch

from helpers import count_ahead_launches, host_syncs_raise, step_without_host_sync
from kestrel.config import EngineConfig
from kestrel.llm import build_engine
from kestrel.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

# preset[+routed-expert format] -> target (the MXFP4 Kimi Linear target: W4A16 decode kernels and its own shared
# expert launches inside the graphs)
TARGETS = {"kimi-linear-tiny": "kimi_linear_bf16__sm_90__default", "k3-tiny": "kimi_k3_bf16__sm_90__default",
           "kimi-linear-tiny+mxfp4": "kimi_linear_mxfp4__sm_90__default"}
PRESETS = sorted(TARGETS)
TOKENS = 64


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from kestrel.models.kimi.checkpoint import make_checkpoint
    out = {}
    for key in PRESETS:
        preset, _, quant = key.partition("+")
        path = str(tmp_path_factory.mktemp(key))            # the folder name starts with the key
        make_checkpoint(preset, path, seed=5, dtype=torch.bfloat16, with_tokenizer=False, quant=quant or None)
        out[key] = path
    return out


class _Logits:
    """Stands in for the engine's runner and keeps a copy of every step's logits (a graph's output buffer is
    rewritten by the next replay)."""

    def __init__(self, runner):
        self.runner, self.steps = runner, []

    def __getattr__(self, name):            # everything else the engine asks of its runner (its timers, graphs)
        return getattr(self.runner, name)

    def __call__(self, batch):
        out = self.runner(batch)
        self.steps.append(out.clone())
        return out


def _engine(path, eager: bool, max_num_seqs: int = 64, **kw):
    """An engine on the checkpoint's bf16 target, built directly (the router lets targets claim real widths only):
    made on the reference model (not capturable: nothing captured), then the target swapped in and captured."""
    import importlib
    import os
    args = dict(kv_cache_tokens=64 * 1024, **kw) if "gpu_memory_utilization" not in kw else kw
    ec = EngineConfig(model=path, dtype="bfloat16", device="cuda", modeling="off", max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=2048, enable_prefix_caching=False, max_model_len=4096,
                      enforce_eager=eager, **args)
    engine = build_engine(ec)
    preset = max((p for p in TARGETS if os.path.basename(path).startswith(p)), key=len)
    target = importlib.import_module(f"kestrel.models.kimi.targets.{TARGETS[preset]}.modeling").build(
        engine.model, engine.config)
    engine.model = engine.runner.model = target
    engine.runner.capturable = not eager
    engine.runner.capture(engine.max_model_len)
    return engine


def _greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)


def _run(engine, batch: int, seed: int, params=_greedy):
    """`batch` random prompts, request i with `params(i)`, run to the end: (each request's tokens, every step's
    logits)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    rec = _Logits(engine.runner)
    engine.runner = rec
    ids = [engine.add_request(torch.randint(0, vocab, (int(n),), generator=gen).tolist(), params(i))
           for i, n in enumerate(torch.randint(8, 40, (batch,), generator=gen))]
    while engine.has_unfinished():
        engine.step()
    engine.runner = rec.runner
    return [engine.final_output(i).token_ids for i in ids], rec.steps


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_graphs_equal_eager_bitwise(checkpoints, preset, batch):
    graphs, eager = _engine(checkpoints[preset], False), _engine(checkpoints[preset], True)
    assert graphs.runner.graphs and not eager.runner.graphs
    replays = graphs.runner.replays
    got, got_logits = _run(graphs, batch, seed=batch)
    want, want_logits = _run(eager, batch, seed=batch)
    assert graphs.runner.replays - replays >= TOKENS - 1         # every decode step replayed a graph
    _assert_same_bitwise(got, got_logits, want, want_logits)


def _assert_same_bitwise(got, got_logits, want, want_logits):
    """Two runs of `_run`: the same steps, every step's logits equal bit for bit, the same tokens."""
    assert len(got_logits) == len(want_logits)
    for step, (a, b) in enumerate(zip(got_logits, want_logits)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item()}"
    assert got == want


@pytest.mark.parametrize("preset", PRESETS)
def test_padded_graph_equals_padded_eager_bitwise(checkpoints, preset):
    graphs = _engine(checkpoints[preset], False, max_num_seqs=16)
    padded_eager = _engine(checkpoints[preset], False, max_num_seqs=16)
    padded_eager.runner.graphs.clear()              # same padding to bucket 8, run eagerly
    got, got_logits = _run(graphs, 5, seed=11)
    want, want_logits = _run(padded_eager, 5, seed=11)
    assert padded_eager.runner.replays == 0 and graphs.runner.replays >= TOKENS - 1
    for a, b in zip(got_logits, want_logits):
        assert a.shape[0] == 5 and torch.equal(a, b)
    assert got == want


@pytest.mark.parametrize("preset", PRESETS)
def test_decode_step_makes_no_host_sync(checkpoints, preset):
    """Build and run decode steps eagerly (graphs off, padding on) under CUDA's sync debug mode: a host sync in
    the inputs, the block-table flush, the StepPlan or any kernel launch raises."""
    engine = _engine(checkpoints[preset], False, max_num_seqs=8)
    engine.runner.graphs.clear()
    for n in (12, 30, 7):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    engine.step()                                   # prefill (eager, may sync)
    sched = engine.scheduler.schedule()
    assert sched and all(s.num_tokens == 1 for s in sched)
    batch, _, logits = step_without_host_sync(engine, sched)
    assert batch.padded_rows == 1 and logits.shape[0] == 3


@pytest.fixture(scope="class", params=PRESETS)
def async_pair(request, checkpoints):
    """Two graph engines of a preset (max_num_seqs 64), async scheduling on and off, shared by the class's tests
    (each run leaves their pools empty) and freed after them."""
    import gc
    pair = [_engine(checkpoints[request.param], False, async_scheduling=on) for on in (True, False)]
    yield pair
    pair.clear()                 # pytest keeps the fixture's value a while longer: empty it to free the engines
    gc.collect()                 # the runner's graphs and the cache hold each other
    torch.cuda.empty_cache()


class TestAsyncScheduling:
    @pytest.mark.parametrize("batch", [1, 8, 64])
    def test_equals_sync_bitwise(self, async_pair, batch):
        """Graphs on both; async scheduling on in one. Every request ends by length at the same step, so both
        engines run the same steps (no dropped rows): the same logits bit for bit, the same tokens."""
        on, off = async_pair
        assert on.async_scheduling and not off.async_scheduling and on.runner.graphs
        ahead = count_ahead_launches(on)
        replays = on.runner.replays
        got, got_logits = _run(on, batch, seed=batch)
        want, want_logits = _run(off, batch, seed=batch)
        assert ahead[0] >= TOKENS - 3 and on.runner.replays - replays >= TOKENS - 1
        _assert_same_bitwise(got, got_logits, want, want_logits)

    def test_sampled_with_stops(self, async_pair):
        """Seeded top-p sampling on the GPU sampler (its position is one ahead of what the host has appended when a
        step is launched) with requests ending at different steps: by max_tokens, and by a stop token the host only
        sees after the next step was launched (that row's token is dropped): the same tokens as with async off."""
        def params(stop):
            return lambda i: SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i, max_tokens=20 + 5 * i,
                                            ignore_eos=True, stop_token_ids=stop(i))
        on, off = async_pair
        free, _ = _run(off, 8, 3, params(lambda i: []))
        stops = params(lambda i: [free[i][3 + i]] if i % 2 else [])
        ahead = count_ahead_launches(on)
        got, _ = _run(on, 8, 3, stops)
        want, _ = _run(off, 8, 3, stops)
        assert got == want and ahead[0] > 10
        assert any(len(t) < 20 + 5 * i for i, t in enumerate(want))       # some stop tokens ended requests early


@pytest.mark.parametrize("preset", PRESETS)
def test_async_decode_step_makes_no_host_sync(checkpoints, preset):
    """A steady async step (the next decode launched from the previous step's ids on the device, then that step's
    bookkeeping) under CUDA's sync debug mode: no host sync is made, and the host waits only once, on the CUDA event
    of the previous step's ids."""
    engine = _engine(checkpoints[preset], False, max_num_seqs=8, async_scheduling=True)
    for n in (12, 30, 7):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    engine.step()                                   # prefill (synchronous, may sync)
    engine.step()                                   # the first decode, and the next launched ahead of it
    assert engine._inflight is not None
    waits = []                                      # (event, whether it had completed when the host waited)
    real = torch.cuda.Event.synchronize
    torch.cuda.Event.synchronize = lambda ev: (waits.append((ev, ev.query())), real(ev))[1]
    replays = engine.runner.replays
    try:
        with host_syncs_raise():
            outs = engine.step()
    finally:
        torch.cuda.Event.synchronize = real
    assert len(outs) == 3 and engine._inflight is not None and engine.runner.replays == replays + 1
    on_ids = [done for ev, done in waits if any(ev is e for e in engine._copy_events)]
    assert len(on_ids) == 1
    # the pinned staging buffers (inputs, sampler rows) wait for copies two steps old: long done, never a stall
    assert all(done for ev, done in waits if not any(ev is e for e in engine._copy_events))


@pytest.mark.parametrize("preset", PRESETS)
def test_no_triton_compile_after_capture(checkpoints, preset):
    """Every Triton specialization a decode bucket launches was compiled during warm-up: serving decode steps at
    a new batch size compile nothing."""
    import triton
    engine = _engine(checkpoints[preset], False, max_num_seqs=64)
    for n in (12, 30, 7, 19, 33):                  # prefill shapes compile here, before the counted decode
        engine.add_request(list(range(3, 3 + n)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    compiled = []
    hook = triton.knobs.runtime.jit_post_compile_hook if hasattr(triton, "knobs") else None
    if hasattr(triton, "knobs"):
        triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(k.get("repr"))
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        if hasattr(triton, "knobs"):
            triton.knobs.runtime.jit_post_compile_hook = hook
    assert engine.runner.replays > 0
    assert not compiled, f"{len(compiled)} Triton kernels compiled on the serving path: {compiled[:3]}"


@pytest.mark.parametrize("preset", PRESETS)
def test_no_triton_compile_for_a_burst_of_prompts(checkpoints, preset):
    """What `benchmarks/jit_probe.py` found on the H200 (the short conv and MLA prefill compiled per segment-count
    class on the first batch-64 run): 48 prompts arriving together run chunked prefills beside decodes (every
    segment count from 1 to 48 and more), then bursts of short prompts prefill 40 and 24 segments in one step
    (the per-segment blocks of 64 and 32 that a warm-up with every segment on one slot never ran), and no Triton
    kernel compiles after start-up."""
    from helpers import triton_compiles
    engine = _engine(checkpoints[preset], False, max_num_seqs=64)
    gen = torch.Generator().manual_seed(7)
    vocab = engine.config.vocab_size
    with triton_compiles() as compiled:
        for count, lo, hi in ((48, 20, 300), (40, 8, 40), (24, 8, 40)):
            for n in torch.randint(lo, hi, (count,), generator=gen).tolist():
                engine.add_request(torch.randint(0, vocab, (n,), generator=gen).tolist(),
                                   SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
    assert not compiled, f"{len(compiled)} Triton kernels compiled on the serving path: {compiled[:3]}"


def test_engine_compiles_no_sampler_kernel_on_its_first_top_p_batch(checkpoints):
    """Start-up warms the sampler (`Sampler.warm_up` from `Engine.__init__`: every variant of its Triton kernels
    compiled there); the engine's first batch of 64 top-p requests, then one mixing top-k, min-p, plain and greedy
    rows, compiles none of the sampler's kernels."""
    from helpers import SAMPLER_VARIANTS, forget_compiled_sampler_kernels, sampler_kernels, triton_compiles
    names = set(sampler_kernels())
    forget_compiled_sampler_kernels()          # earlier tests of this process may have compiled them
    with triton_compiles() as start:
        engine = _engine(checkpoints["kimi-linear-tiny"], False, max_num_seqs=64)
    assert len([n for n in start if n in names]) == SAMPLER_VARIANTS, start
    mixed = [dict(temperature=1.0, top_k=20), dict(temperature=0.7, min_p=0.1), dict(temperature=0.0),
             dict(temperature=0.9), dict(temperature=0.8, top_k=10, top_p=0.9)]
    with triton_compiles() as serving:
        for batch in ([dict(temperature=0.8, top_p=0.95)], mixed):
            for i in range(64):
                engine.add_request(list(range(3, 10 + i % 7)), SamplingParams(**batch[i % len(batch)], seed=i,
                                                                              max_tokens=8, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
    assert engine.runner.replays > 0
    got = [n for n in serving if n in names]
    assert not got, f"{len(got)} sampler kernels compiled on the serving path: {got}"


def test_memory_plan_profiles_and_caps_the_allocator(checkpoints, caplog):
    """Pools sized from what the card has left after weights, the profiled activations and the graphs; the
    caching allocator is capped below the reserve; one log line names the split."""
    import gc
    import logging
    caplog.set_level(logging.INFO)
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    try:
        _check_memory_plan(checkpoints, caplog, total)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)      # the cap is per process: lift it for later tests


def _check_memory_plan(checkpoints, caplog, total):
    engine = _engine(checkpoints["kimi-linear-tiny"], False, max_num_seqs=16, gpu_memory_utilization=0.05,
                     memory_reserve_gib=1.0)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: weights"))
    assert all(w in line for w in ("activations", "graphs", "pools", "reserve"))
    assert engine.runner.graphs and engine.runner.graph_bytes > 0
    cap = total * 0.05 - 2 ** 30
    assert engine.cache.nbytes() < cap and torch.cuda.memory_reserved() <= cap
    with pytest.raises(torch.cuda.OutOfMemoryError):          # the cap holds: the reserve stays outside the allocator
        torch.empty(int(cap) + 2 ** 20, dtype=torch.uint8, device="cuda")
    ids = [engine.add_request(list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
           for _ in range(16)]
    while engine.has_unfinished():
        engine.step()
    assert all(len(engine.final_output(i).token_ids) == 8 for i in ids)
