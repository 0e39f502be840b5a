"""KDA verify with replay in the reference model: a verify block leaves the state slot as it was, and
`commit_verify` with a accepted tokens gives the state that plain decode over those tokens gives (fp32: a few ulps,
grown through the layers)."""

from __future__ import annotations

import pytest
import torch

from helpers import PagedRequests, load_model, single_thread, tiny_checkpoint  # noqa: F401

PROMPT = 23
K = 4


@pytest.fixture(scope="module")
def model():
    return load_model(tiny_checkpoint("k3-tiny"))


REL_BOUND = 1e-5     # replayed against plain KDA state, relative to max(1, |state|): derived in the test below


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / max(1.0, b.float().abs().max().item())).item()


def _states(cache, slot):
    return [t[slot].clone() for t in list(cache.pools.conv.values()) + list(cache.pools.recurrent.values())]


def _prefilled(config, model, tokens):
    cache = PagedRequests(config, 2, PROMPT + K + 2, page_size=4, seed=3)
    model(cache.batch([(0, tokens[0], 0, PROMPT), (1, tokens[1], 0, PROMPT - 5)]), cache.pools)
    return cache


def _plain_decode(config, model, tokens, n):
    """Request 0 prefilled, then n of its tokens decoded one at a time (request 1's decode beside the first):
    the cache and each step's logits of request 0."""
    cache = _prefilled(config, model, tokens)
    logits = []
    for t in range(PROMPT, PROMPT + n):
        segs = [(0, tokens[0], t, t + 1)] + ([(1, tokens[1], PROMPT - 5, PROMPT - 4)] if t == PROMPT else [])
        logits.append(model(cache.batch(segs), cache.pools)[0])
    return cache, logits


@pytest.mark.parametrize("accepted", [1, 2, K + 1])
def test_commit_equals_plain_decode(model, accepted):
    config, m = model
    g = torch.Generator().manual_seed(accepted)
    tokens = [torch.randint(3, config.vocab_size, (PROMPT + K + 1,), generator=g).tolist() for _ in range(2)]
    # verify: request 0's block [t_P, d_1 .. d_K] beside a plain decode of request 1, then commit
    spec = _prefilled(config, m, tokens)
    before = _states(spec, spec.slots[0])
    batch = spec.batch([(0, tokens[0], PROMPT, PROMPT + K + 1), (1, tokens[1], PROMPT - 5, PROMPT - 4)])
    batch.verify_segments = (0,)
    verify_logits = m(batch, spec.pools)
    for a, b in zip(before, _states(spec, spec.slots[0])):
        assert torch.equal(a, b), "a verify block must leave the state slot untouched"
    m.commit_verify([accepted], spec.pools)
    # plain decode of the same tokens, one at a time
    plain, plain_logits = _plain_decode(config, m, tokens, accepted)
    # The bound: fp32 matmuls over the K + 1-row block and over a 1-row decode take different BLAS kernels, so each
    # layer's inputs differ by a few ulps (layer 0's conv state, the projection of the same embeddings: ~3 ulps,
    # 2e-7 relative) and the differences grow through the layers (k3-tiny's four: up to 1.5e-6 relative, and more
    # on some CPUs' kernels). A wrong commit (one token too few or too many) moves the state by over 1e-2 relative.
    for a, b in zip(_states(spec, spec.slots[0]), _states(plain, plain.slots[0])):
        assert _rel(a, b) <= REL_BOUND
    # the other request's decode in the same step advanced normally
    for a, b in zip(_states(spec, spec.slots[1]), _states(plain, plain.slots[1])):
        assert _rel(a, b) <= REL_BOUND
    # the bound tells a wrong commit apart: the state one token short (the prefilled one, for one accepted token)
    short, _ = _plain_decode(config, m, tokens, accepted - 1)
    short = _states(short, short.slots[0])
    assert max(_rel(a, b) for a, b in zip(_states(spec, spec.slots[0]), short)) > 100 * REL_BOUND
    # the block's rows score what plain decode scores at those positions (the verify's logits are usable)
    for i, lp in enumerate(plain_logits):
        assert (verify_logits[i] - lp).abs().max() <= 1e-4 * lp.abs().max()


def test_commit_count_must_match(model):
    config, m = model
    tokens = [list(range(3, 3 + PROMPT + K + 1))] * 2
    cache = _prefilled(config, m, tokens)
    batch = cache.batch([(0, tokens[0], PROMPT, PROMPT + K + 1)])
    batch.verify_segments = (0,)
    m(batch, cache.pools)
    with pytest.raises(ValueError, match="verify blocks"):
        m.commit_verify([1, 1], cache.pools)
