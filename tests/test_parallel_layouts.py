"""Every layout over several CPU ranks (gloo) gives tp1's greedy tokens, on tiny Kimi Linear and K3 checkpoints.

Each scenario runs on one engine: a first call (one request: chunked prefill; under DEP the second rank has no
work and runs its MoE on zero tokens), then a second call of three requests at once (a prefix hit on the first
call's pages, a long prompt cut into chunks beside decodes: a mixed batch; under DEP two requests on one rank and
one on the other). 32 greedy tokens each, fp32.

The ranks start once per module (their imports dominate on a small machine): one process per rank runs every
(checkpoint, layout) job of its world size in turn over the same process group, rank 0 reporting the tokens.
"""

from __future__ import annotations

import pytest
import torch

from helpers import single_thread, tiny_checkpoint  # noqa: F401
from kestrel import LLM, SamplingParams
from kestrel.parallel.launch import RankGroup

ENGINE = dict(device="cpu", dtype="float32", page_size=8, max_num_batched_tokens=16, kv_cache_tokens=1024,
              max_num_seqs=4)
PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PREFIX = [(7 * i + 3) % 1000 + 1 for i in range(20)]
FIRST = [PREFIX + [11, 12, 13]]
SECOND = [PREFIX + [21, 22], [(5 * i) % 900 + 2 for i in range(37)], [4, 8, 15, 16]]

LAYOUTS_2 = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2_ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "dep2": dict(data_parallel_size=2, enable_expert_parallel=True),
    "helix2": dict(helix_size=2),
    "helix2_moetp1ep2": dict(helix_size=2, enable_expert_parallel=True, moe_tp_size=1),
}
LAYOUTS_4 = {
    "tp4": dict(tensor_parallel_size=4),
    "dep4": dict(data_parallel_size=4, enable_expert_parallel=True),
    "helix4_moetp2ep2": dict(helix_size=4, enable_expert_parallel=True, moe_tp_size=2),
}
PRESETS = ("kimi-linear-tiny", "k3-tiny")
LAYERS = {"kimi-linear-tiny": None, "k3-tiny": 4}     # K3 cut to 4 layers: KDA, dense, MoE, MLA, two res blocks


def checkpoint(preset: str) -> str:
    return tiny_checkpoint(preset, LAYERS[preset])


def scenario(llm: LLM) -> tuple[list[list[int]], int]:
    """The tokens of both calls, and the prompt tokens the second call found in the prefix cache."""
    first = [list(o.token_ids) for o in llm.generate(FIRST, PARAMS)]
    second = llm.generate(SECOND, PARAMS)
    return first + [list(o.token_ids) for o in second], second[0].metrics.cached_tokens


def _jobs_worker(jobs, conn) -> None:
    """One rank: build each job's engine over the one process group; rank 0 runs the scenario and answers."""
    import torch
    from kestrel.config import EngineConfig
    from kestrel.llm import run_rank, setup_engine
    torch.set_num_threads(1)
    results = {}
    for name, kwargs in jobs:
        engine = run_rank(setup_engine(EngineConfig(**kwargs)))
        if engine is None:           # a follower: rank 0 has finished this job
            continue
        results[name] = scenario(LLM.over(engine))
        engine.stop()
    if conn is not None:
        conn.recv()
        conn.send(("ok", results))


def run_layouts(layouts: dict, world: int, presets=PRESETS, device: str = "cpu") -> dict:
    jobs = [(f"{preset}/{name}", dict(model=checkpoint(preset), **{**ENGINE, "device": device}, **flags))
            for preset in presets for name, flags in layouts.items()]
    from kestrel.config import EngineConfig
    ec = EngineConfig(**jobs[0][1])
    assert ec.world_size == world
    group = RankGroup(ec, _jobs_worker, jobs)
    try:
        return group.call("results")
    finally:
        group.close()


@pytest.fixture(scope="module")
def tp1():
    out = {}
    for preset in PRESETS:
        with LLM(checkpoint(preset), **ENGINE) as llm:
            out[preset] = scenario(llm)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_layouts(LAYOUTS_2, 2)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS_2))
def test_two_ranks_equal_tp1(two_ranks, tp1, preset, layout):
    tokens, cached = two_ranks[f"{preset}/{layout}"]
    ref_tokens, ref_cached = tp1[preset]
    assert ref_cached > 0 and cached == ref_cached          # the second call did hit the prefix cache
    assert all(len(t) == 32 for t in tokens)
    assert tokens == ref_tokens


@pytest.fixture(scope="module")
def four_ranks():
    return run_layouts(LAYOUTS_4, 4)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS_4))
def test_four_ranks_equal_tp1(four_ranks, tp1, preset, layout):
    """tp4, dep4 (three requests over four DP ranks: one rank idle in every step) and helix4 x moe-tp 2 x ep 2."""
    tokens, cached = four_ranks[f"{preset}/{layout}"]
    assert cached == tp1[preset][1]
    assert tokens == tp1[preset][0]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_two_gpus_nccl_equal_one_gpu():
    """The GPU session's check: the same layouts over NCCL, fp32 on two GPUs, against one GPU."""
    want = {}
    for preset in PRESETS:
        with LLM(checkpoint(preset), **{**ENGINE, "device": "cuda"}) as llm:
            want[preset] = scenario(llm)
    got = run_layouts(LAYOUTS_2, 2, device="cuda")
    for key, (tokens, cached) in got.items():
        assert tokens == want[key.split("/")[0]][0], key
