"""Speculative verify on the sm_90 targets (the catalog forwards, built at tiny widths; on the CPU their Triton
kernels run under the interpreter in fp32): a verify block leaves the KDA slots untouched and `commit_verify` gives
the state plain decode of the accepted tokens gives; greedy with speculation (a scripted oracle proposer, ngram) equals
greedy without it token for token, through chunked prefill and blocks that accept no draft; the captured hidden
states are the reference model's."""

from __future__ import annotations

import importlib

import pytest
import torch

from helpers import PagedRequests, single_thread  # noqa: F401

from kestrel.config import EngineConfig, ModelConfig
from kestrel.models.kimi.checkpoint import preset_config, random_reference_model
from kestrel.runtime.cache import HybridCache
from kestrel.runtime.engine import Engine
from kestrel.sampling_params import SamplingParams
from kestrel.spec.proposer import DraftBlock, Proposer

TARGETS = {"k3-tiny": "kimi_k3_bf16__sm_90__default", "kimi-linear-tiny": "kimi_linear_bf16__sm_90__default"}
K = 4
PROMPT = 20
# two layers (KDA with the dense FFN, MLA with the MoE: every mixer and FFN the targets run): under the interpreter
# the step time grows with the layers and the tokens, so the tests keep both small
LAYERS = 2
# a small vocabulary: a random model's greedy tokens repeat, so the ngram proposer finds matches in short prompts
VOCAB = 16
# the fp32 interpreter tests: on a CUDA machine Triton compiles instead, and these CPU tensors cannot reach it there
# (the CUDA test below runs the same targets on the GPU)
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the fp32 Triton-interpreter test (CPU only)")


def _build(preset, dtype=torch.float32, device="cpu"):
    """The preset cut to LAYERS layers with a VOCAB-token vocabulary (random weights, seeded), its reference model
    and the target built over it."""
    raw = preset_config(preset, LAYERS)
    raw.get("text_config", raw)["vocab_size"] = VOCAB
    config = ModelConfig.from_dict(raw)
    ref = random_reference_model(config, dtype, torch.device(device), seed=3)
    target = importlib.import_module(f"kestrel.models.kimi.targets.{TARGETS[preset]}.modeling").build(ref, config)
    return config, ref, target


@pytest.fixture(scope="module", params=sorted(TARGETS))
def built(request):
    return (request.param, *_build(request.param))


def _states(cache, slot):
    return [t[slot].clone() for t in list(cache.pools.conv.values()) + list(cache.pools.recurrent.values())]


def _close(a, b, rel=1e-5):
    return (a.float() - b.float()).abs().max().item() <= rel * max(1.0, b.float().abs().max().item())


def _context(config, seed):
    """Pages and KDA slots for 3 requests that already hold PROMPT tokens of random context (random latents and
    states: how a state came about does not matter to the step, and no prefill has to run under the interpreter)."""
    cache = PagedRequests(config, 3, PROMPT + K + 2, page_size=16, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for t in list(cache.pools.conv.values()) + list(cache.pools.recurrent.values()):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) * 0.3)
    return cache


@interpreter_only
def test_verify_commit_equals_plain_decode(built):
    """Two verify blocks in one step beside a plain decode: one accepts no draft (1 token kept), the other 3 of
    its K + 1 tokens; after commit each slot holds what decoding those tokens one by one gives (fp32 bound), and
    the blocks' rows score what plain decode scores."""
    preset, config, _, target = built
    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(3, config.vocab_size, (PROMPT + K + 1,), generator=g).tolist() for _ in range(3)]
    accepted = [1, 3]
    spec, plain = _context(config, 3), _context(config, 3)
    before = [_states(spec, spec.slots[r]) for r in range(2)]
    batch = spec.batch([(0, tokens[0], PROMPT, PROMPT + K + 1), (1, tokens[1], PROMPT - 1, PROMPT + K),
                        (2, tokens[2], PROMPT - 2, PROMPT - 1)])
    batch.verify_segments = (0, 1)
    verify_logits = target(batch, spec.pools)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(before[r], _states(spec, spec.slots[r]))), \
            "a verify block must leave its KDA slot untouched"
    with pytest.raises(ValueError, match="verify blocks"):
        target.commit_verify([1], spec.pools)
    target.commit_verify(accepted, spec.pools)

    starts, plain_logits = (0, K + 1), ([], [])
    for t in range(max(accepted)):
        segs = [(r, tokens[r], PROMPT - r + t, PROMPT - r + t + 1) for r in range(2) if t < accepted[r]]
        segs += [(2, tokens[2], PROMPT - 2, PROMPT - 1)] if t == 0 else []
        out = target(plain.batch(segs), plain.pools)
        for i, (r, *_rest) in enumerate(segs):
            if r < 2:
                plain_logits[r].append(out[i])
    for r in range(3):
        for a, b in zip(_states(spec, spec.slots[r]), _states(plain, plain.slots[r])):
            assert _close(a, b), (preset, r)
    for r in range(2):
        for i, lp in enumerate(plain_logits[r]):
            assert _close(verify_logits[starts[r] + i], lp, 1e-4), (preset, r, i)


@interpreter_only
def test_captured_hidden_is_the_reference(built):
    """capture_layers / captured_hidden mean what the reference model's mean (the drafter's input)."""
    preset, config, ref, target = built
    layers = (0, config.num_layers - 1)
    ids = torch.randint(3, config.vocab_size, (PROMPT + 3,), generator=torch.Generator().manual_seed(2)).tolist()
    got = {}
    for name, model in (("ref", ref), ("target", target)):
        cache = _context(config, 1)
        model.capture_layers = layers
        model(cache.batch([(0, ids, PROMPT, PROMPT + 3), (1, ids, PROMPT, PROMPT + 1)]), cache.pools)
        got[name] = dict(model.captured_hidden)
        model.capture_layers = ()
    assert set(got["target"]) == set(layers)
    for i in layers:
        assert _close(got["target"][i], got["ref"][i], 1e-4), (preset, i)


class Scripted(Proposer):
    """Drafts from the known greedy continuation, cycling through all K right, a wrong first draft (the block
    accepts no draft), and two right drafts then a wrong one; it also asks for the hidden states of
    the first and last layer, as a drafter would, and checks each step hands them over for every row."""
    method = "scripted"

    def __init__(self, prompts, outputs, layers, k):
        self.num_tokens, self.capture_layers = k, layers
        self.truth = [list(p) + list(o) for p, o in zip(prompts, outputs)]
        self.calls, self.observed = 0, 0

    def observe(self, batch, hidden, pools) -> None:
        assert set(hidden) == set(self.capture_layers)
        assert all(h.shape[0] == batch.token_ids.shape[0] and torch.isfinite(h).all() for h in hidden.values())
        self.observed += 1

    def propose(self, inputs, block_tables, pools) -> DraftBlock:
        rows = []
        for x in inputs:
            ids = list(x.token_ids)
            truth = next((t for t in self.truth if t[:len(ids)] == ids), ids)     # off the known path: junk
            k = self.num_tokens
            nxt = (truth[len(ids):] + [3] * k)[:k]
            right = (k, 0, 2)[self.calls % 3]
            self.calls += 1
            rows.append([t if j < right else 3 + (t + 1 - 3) % (VOCAB - 3) for j, t in enumerate(nxt)])
        return DraftBlock(torch.tensor(rows))


def _scripted(engine, prompts, want, config) -> None:
    """Swap the engine's proposer for a Scripted one, and have the model capture its layers (as Engine does for
    the proposer it builds)."""
    engine.proposer = Scripted(prompts, want, (0, config.num_layers - 1), engine.proposer.num_tokens)
    engine.model.capture_layers = engine.proposer.capture_layers


def _engine(config, model, spec=None, device="cpu", dtype=torch.float32, eager=True):
    ec = EngineConfig(model="tiny", max_num_seqs=4, max_num_batched_tokens=8, page_size=16,
                      enable_prefix_caching=False, speculative_config=spec, enforce_eager=eager)
    cache = HybridCache(config, num_pages=24, page_size=16, num_slots=4, num_snapshots=0, max_pages_per_seq=6,
                        dtype=dtype, device=torch.device(device), prefix_caching=False)
    return Engine(config, ec, model, cache, tokenizer=None)


def _greedy(engine, prompts, n):
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [list(engine.final_output(i).token_ids) for i in ids]


def _prompts(config):
    g = torch.Generator().manual_seed(5)
    # 11 tokens: a prefill chunked at the 8-token budget while the short prompt verifies beside it
    return [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (11, 3)]


@interpreter_only
def test_greedy_speculation_equals_plain_on_the_target(built):
    """Greedy with speculation on the target equals greedy without it: the plain tokens come from the reference
    model (tests/test_targets.py holds the plain target to them in fp32; the reference runs in torch, not under the
    interpreter, which keeps this test's time to the speculative runs)."""
    preset, config, ref, target = built
    prompts, n, k = _prompts(config), 5, 3       # k: a block of k + 1 still fits the 4 tokens left after prefill
    want = _greedy(_engine(config, ref), prompts, n)
    oracle = _engine(config, target, {"method": "ngram", "num_speculative_tokens": k, "enforce": True})
    _scripted(oracle, prompts, want, config)
    assert _greedy(oracle, prompts, n) == want
    target.capture_layers = ()
    st = oracle.stats()["spec"]
    assert st["accept_len_hist"]["1"] > 0 and st["accept_len_hist"][str(k + 1)] > 0, st   # none and all accepted
    assert oracle.proposer.observed == oracle.num_steps
    ngram = _engine(config, target, {"method": "ngram", "num_speculative_tokens": k, "enforce": True,
                                     "prompt_lookup_min": 1})
    assert _greedy(ngram, prompts, n) == want
    assert ngram.stats()["spec"]["verify_blocks"] > 0


def _last_logits(model, config, ids, device, dtype) -> torch.Tensor:
    """fp32 logits after `ids` (one request, one prefill, fresh pools)."""
    from kestrel.models.kimi.step import CachePools, StepBatch
    pages = -(-len(ids) // 16)
    pools = CachePools.allocate(config, pages, 16, 1, dtype, device)
    n = len(ids)
    batch = StepBatch(torch.tensor(ids, device=device), torch.arange(n, device=device), [0, n], [0],
                      torch.zeros(1, dtype=torch.long, device=device),
                      torch.arange(pages, dtype=torch.int32, device=device).view(1, -1),
                      torch.tensor([n - 1], device=device))
    return model(batch, pools)[-1].float()


def assert_equal_up_to_near_ties(got, want, prompts, oracle, config, device):
    """got == want token for token, except that a request may part from want where the fp32 oracle's top two
    tokens are both its candidates and lie within bf16's reach of each other (the verify rows and the decode rows
    run different kernels, whose bf16 roundings differ; past such a point the two continuations are different
    texts). Returns how many requests parted."""
    parted = 0
    for p, g, w in zip(prompts, got, want):
        i = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if i is None:
            assert len(g) == len(w)
            continue
        logits = _last_logits(oracle, config, list(p) + list(w[:i]), device, torch.float32)
        top = logits.topk(2)
        margin = (top.values[0] - top.values[1]).item()
        assert {g[i], w[i]} == set(top.indices.tolist()) and margin < 0.05 * logits.abs().max().item(), \
            (i, g, w, top)
        parted += 1
    return parted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", sorted(TARGETS))
def test_cuda_bf16_target_speculation_equals_plain(preset):
    """On a GPU: the target in bf16 with decode CUDA graphs on; greedy with speculation (the scripted proposer with
    hidden-state capture, ngram) equals greedy without it token for token, up to near-ties of the fp32 oracle (the
    reference model over the same bf16 weights in fp32); decode graphs replayed."""
    config, ref, target = _build(preset, torch.bfloat16, "cuda")
    oracle = _build(preset, torch.float32, "cuda")[1]
    oracle.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    prompts, n = _prompts(config), 12
    plain = _engine(config, target, device="cuda", dtype=torch.bfloat16, eager=False)
    want = _greedy(plain, prompts, n)
    assert plain.runner.replays > 0
    parted = 0
    for spec in ({"method": "ngram", "num_speculative_tokens": K, "enforce": True},
                 {"method": "ngram", "num_speculative_tokens": K, "enforce": True, "prompt_lookup_min": 1}):
        engine = _engine(config, target, spec, device="cuda", dtype=torch.bfloat16, eager=False)
        if "prompt_lookup_min" not in spec:
            _scripted(engine, prompts, want, config)
        got = _greedy(engine, prompts, n)
        target.capture_layers = ()
        parted += assert_equal_up_to_near_ties(got, want, prompts, oracle, config, "cuda")
        st = engine.stats()["spec"]
        assert st["verify_blocks"] > 0
        if "prompt_lookup_min" not in spec:
            assert st["accepted_tokens"] > 0 and engine.proposer.observed == engine.num_steps
    assert parted <= len(prompts), "most requests must follow the plain tokens to the end"


def test_a_model_that_cannot_verify_is_refused_in_one_line(built):
    """--speculative-config on a model without a verify step: a ConfigError naming the model and the way out."""
    from kestrel.errors import ConfigError
    _, config, _, _ = built

    class NoVerify:
        def __call__(self, batch, pools):
            raise AssertionError("never run")

    with pytest.raises(ConfigError, match="NoVerify has no speculative verify step") as e:
        _engine(config, NoVerify(), {"method": "ngram", "num_speculative_tokens": K})
    assert "\n" not in str(e.value) and "--modeling off" in str(e.value)


@pytest.mark.parametrize("preset, want", [("k3", "kimi_k3_bf16__sm_90__default"),
                                          ("kimi-linear-48b", "kimi_linear_bf16__sm_90__default")])
def test_speculation_routes_to_the_targets(preset, want):
    from kestrel import contract
    from kestrel.models.kimi.routing import ModelingContext, route
    for spec in ("none", "ngram", "dspark"):
        ctx = ModelingContext(config=contract.claimed_config(preset, {"quant": "bf16"}, 2), arch="sm_90",
                              quant="bf16", kv_cache_dtype="bf16", spec=spec)
        assert route(ctx, "require")[0] == want, spec
