"""Shared helpers of the runtime tests (tiny checkpoints made once per process, engines, solo runs), plus the unit
tests of the pieces under the engine: chained page keys, the memory plan and its log line, appending layers."""

from __future__ import annotations

import functools
import random
import shutil
import tempfile
import atexit
from array import array

import pytest
import torch

# Tiny models: thread hand-offs cost more than the math, and other test processes share the cores.
torch.set_num_threads(1)

from kestrel.config import EngineConfig, ModelConfig  # noqa: E402
from kestrel.errors import ConfigError  # noqa: E402
from kestrel.llm import build_engine  # noqa: E402
from kestrel.models.kimi.checkpoint import make_checkpoint, preset_config  # noqa: E402
from kestrel.runtime.cache import HybridCache, chain_hashes  # noqa: E402
from kestrel.runtime.memory import plan_cache  # noqa: E402
from kestrel.sampling_params import SamplingParams  # noqa: E402

_ROOT = tempfile.mkdtemp(prefix="kestrel-runtime-tests-")
atexit.register(shutil.rmtree, _ROOT, True)


@functools.lru_cache(maxsize=None)
def tiny_checkpoint(preset: str = "k3-tiny") -> str:
    """A tiny fp32 checkpoint (random trained-like weights, demo tokenizer), written once per test process."""
    return make_checkpoint(preset, f"{_ROOT}/{preset}", seed=0, dtype=torch.float32)


def make_engine(preset: str = "k3-tiny", **kw):
    args = dict(dtype="float32", device="cpu", page_size=16, kv_cache_tokens=16384, max_num_seqs=32,
                max_num_batched_tokens=2048, enable_prefix_caching=True)
    args.update(kw)
    return build_engine(EngineConfig(model=tiny_checkpoint(preset), **args))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_to_end(engine, limit: int = 100000) -> None:
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("the engine did not finish its requests")


def solo_tokens(preset: str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Each request run alone, cold (no prefix cache), whole prompt in one step: the reference outputs."""
    engine = make_engine(preset, enable_prefix_caching=False, max_num_batched_tokens=1 << 20)
    out = []
    for p, n in zip(prompts, max_tokens):
        rid = engine.add_request(p, greedy(n))
        run_to_end(engine)
        out.append(engine.final_output(rid).token_ids)
        engine.release(rid)
    return out


def random_prompts(seed: int, lengths: list[int], vocab: int = 1000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_pool_empty(engine) -> None:
    """Nothing in flight holds cache memory: every page is free or merely cached, every slot is free."""
    c = engine.cache
    assert c.used_pages == 0 and c.used_slots == 0
    assert all(r == 0 for r in c.ref)
    assert len(c.free_pages) + len(c.evictable) == c.num_pages
    assert bool((c.block_tables_host[:c.num_slots] == -1).all())      # the last row is the scratch row


# ---------------------------------------------------------------------------------------------------------------
# unit tests of the pieces

def test_chain_hashes_cover_the_whole_prefix():
    a = list(range(100))
    b = list(range(100))
    b[3] = 999                       # differs only inside page 0
    ha, hb = chain_hashes(a, 16), chain_hashes(b, 16)
    assert len(ha) == 100 // 16
    assert all(x != y for x, y in zip(ha, hb)), "a page's key must depend on every token before it"
    assert chain_hashes(a[:50], 16) == ha[:3]
    assert chain_hashes(a, 16, known=ha[:2]) == ha
    assert chain_hashes(a, 32) != ha[:3]
    # the prompt's int64 buffer (Request.prompt_array) hashes to the same keys as its list
    assert chain_hashes(array("q", a), 16) == ha
    assert chain_hashes(array("q", a), 16, known=ha[:2]) == ha


def test_step_inputs_derive_positions_and_gather_rows():
    """fill(positions=None) writes each segment's run from its first position, as the explicit list would; the
    vectorized MLA gather rows of several segments equal a per-segment build."""
    from kestrel.catalog.attention.mla_gather import MlaGather
    from kestrel.runtime.inputs import StepInputs
    cu, ctx, slots = [0, 5, 6, 15], [3, 40, 0], [0, 1, 2]
    tokens = list(range(100, 115))
    positions = [c + j for b, c in enumerate(ctx) for j in range(cu[b + 1] - cu[b])]
    table = torch.arange(4 * 8, dtype=torch.int32).view(4, 8)
    explicit = StepInputs(4, 64, 16, 8, "cpu").fill(tokens, positions, cu, ctx, slots, [4, 5, 14], table, [])
    derived = StepInputs(4, 64, 16, 8, "cpu").fill(array("q", tokens), None, cu, ctx, slots, [4, 5, 14], table, [])
    for f in ("token_ids", "positions", "req_idx", "cu_seqlens_dev", "cu_kv_dev", "block_tables"):
        assert torch.equal(getattr(explicit, f), getattr(derived, f)), f
    lens = [8, 0, 21]
    rows = MlaGather.row_index_for(table, lens, 4, "cpu")
    want = torch.cat([table[b, torch.arange(n) // 4].long() * 4 + torch.arange(n) % 4 for b, n in enumerate(lens)])
    assert torch.equal(rows, want)


def test_memory_plan_bytes_tokens_and_log_line():
    raw = preset_config("kimi-linear-tiny")
    cfg = ModelConfig.from_dict(raw)
    ec = EngineConfig(model="x", page_size=16, max_num_seqs=8, kv_cache_tokens=1000)
    plan = plan_cache(cfg, ec, torch.float32, torch.device("cpu"), max_model_len=256)
    assert plan.num_pages == 63 and plan.num_tokens == 63 * 16           # tokens round up to whole pages
    assert plan.num_slots == 8 and plan.num_snapshots == 8
    assert plan.max_pages_per_seq == 16
    line = plan.describe(cfg)
    assert "1008 tokens" in line and "8 concurrent requests" in line and "3 at the full 256-token context" in line
    # requests of a context the bytes hold, each with its slot and its pages (no max_num_seqs cap)
    per = plan.bytes_per_slot + 13 * plan.bytes_per_page           # 200 tokens: 13 pages of 16
    assert plan.requests_by_memory(200) == plan.nbytes // per and plan.requests_by_memory(16) > plan.num_slots
    # the same pool given in bytes: states first, then as many pages as fit
    ec_b = EngineConfig(model="x", page_size=16, max_num_seqs=8, kv_cache_bytes=plan.nbytes)
    plan_b = plan_cache(cfg, ec_b, torch.float32, torch.device("cpu"), max_model_len=256)
    assert plan_b.num_pages == plan.num_pages and plan_b.nbytes == plan.nbytes
    # the plan's bytes are what the cache really allocates
    cache = HybridCache(cfg, plan.num_pages, 16, 8, 8, plan.max_pages_per_seq, torch.float32, torch.device("cpu"))
    assert cache.nbytes() == plan.nbytes
    with pytest.raises(ConfigError, match="kv-cache-bytes"):
        plan_cache(cfg, EngineConfig(model="x", page_size=16, max_num_seqs=8, kv_cache_bytes=1000), torch.float32,
                   torch.device("cpu"), max_model_len=256)
    # extra (drafter) layers share the budget: fewer pages for the same bytes
    plan_d = plan_cache(cfg, ec_b, torch.float32, torch.device("cpu"), max_model_len=256, extra_layers={4: "mla"})
    assert plan_d.num_pages < plan_b.num_pages


def test_add_layers_appends_to_the_same_pools():
    cfg = ModelConfig.from_dict(preset_config("kimi-linear-tiny"))
    cache = HybridCache(cfg, 10, 16, 4, 4, 10, torch.float32, torch.device("cpu"))
    before = cache.nbytes()
    cache.add_layers({cfg.num_layers: "mla", cfg.num_layers + 1: "kda"})
    assert cache.pools.mla[cfg.num_layers].shape == (11, 16, cfg.mla_cache_width)          # + the scratch page
    assert cache.pools.conv[cfg.num_layers + 1].shape[0] == 9          # request slots + snapshot slots + scratch
    assert cache.pools.recurrent[cfg.num_layers + 1].dtype == torch.float32
    assert cache.nbytes() > before
    assert cfg.num_layers in cache.layout()["mla_layers"] and cfg.num_layers + 1 in cache.layout()["kda_layers"]
    with pytest.raises(ValueError, match="already"):
        cache.add_layers({0: "kda"})


def test_engine_runs_with_appended_layers():
    """Appended (drafter) layers ride along: the model's own layers still read the pools as before."""
    engine = make_engine("kimi-linear-tiny")
    prompt = random_prompts(5, [40])[0]
    ref = solo_tokens("kimi-linear-tiny", [prompt], [6])[0]
    n = engine.config.num_layers
    engine.cache.add_layers({n: "mla", n + 1: "kda"})
    rid = engine.add_request(prompt, greedy(6))
    run_to_end(engine)
    assert engine.final_output(rid).token_ids == ref
