"""Speculative acceptance on the device: the emitted tokens are distributed as the target's (chi-square on a tiny
vocabulary, with a synthetic draft distribution q), greedy is the longest matching prefix plus the target's token,
the target distribution is the sampler's (every filter path), and a seeded row draws the same alone or batched."""

from __future__ import annotations

import pytest
import torch

from helpers import single_thread  # noqa: F401
from test_runtime_sampler import chi2_pvalue
from kestrel.runtime.sampler import reference_probs, row_params
from kestrel.sampling_params import SamplingParams
from kestrel.spec.acceptance import accept, filtered_probs

V = 8
K = 3


def _packed(params: list[SamplingParams], seeds: list[int], positions: list[int], vocab: int = V):
    rows = [row_params(p, s, vocab) for p, s in zip(params, seeds)]
    ints = torch.tensor([(k0, k1, pos, k, path) for ((k0, k1, k, path), _), pos in zip(rows, positions)]).T
    floats = torch.tensor([f for _, f in rows], dtype=torch.float32).T
    return ints.contiguous(), floats.contiguous(), frozenset(ints[4].tolist())


def _chi2_ok(samples: torch.Tensor, probs: torch.Tensor) -> None:
    p = chi2_pvalue(samples, probs)
    assert p > 1e-4, f"emitted tokens do not follow the target (chi-square p = {p:.2e})"


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8),
                                    SamplingParams(temperature=1.0, min_p=0.1)])
def test_emitted_tokens_follow_the_target(params):
    """N independent blocks (seeds 0..N-1), drafts drawn from a known q; at every emitted position j the tokens
    of the blocks that got that far are distributed as the target's filtered p_j."""
    N = 30000
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(K + 1, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(K, V, generator=g), -1)
    drafts = torch.multinomial(q, N, replacement=True, generator=g).T.contiguous()          # [N, K]
    ints, floats, paths = _packed([params] * N, list(range(N)), [100] * N)
    res = accept(logits.expand(N, K + 1, V), drafts, torch.full((N,), K), q.expand(N, K, V), ints, floats, paths)
    a = res.num_accepted
    assert 0 < a.float().mean() < K
    for j in range(K + 1):
        reached = a >= j
        _chi2_ok(res.tokens[reached, j], reference_probs(logits[j], params))
    if params.top_k == 0 and params.top_p == 1 and params.min_p == 0:    # the check can fail: q is not p
        assert chi2_pvalue(drafts[:, 0], reference_probs(logits[0], params)) < 1e-4


def test_one_hot_drafts_follow_the_target_too():
    """A proposer that gives no q (n-gram: q one-hot on its guess) is lossless as well."""
    N = 20000
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(K + 1, V, generator=g)
    drafts = torch.randint(0, V, (N, K), generator=g)
    params = SamplingParams(temperature=0.9)
    ints, floats, paths = _packed([params] * N, list(range(N)), [5] * N)
    res = accept(logits.expand(N, K + 1, V), drafts, torch.full((N,), K), None, ints, floats, paths)
    for j in range(K + 1):
        reached = res.num_accepted >= j
        _chi2_ok(res.tokens[reached, j], reference_probs(logits[j], params))


def test_greedy_longest_prefix_plus_bonus():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, K + 1, V, generator=g)
    best = logits.argmax(-1)                                     # [4, K + 1]
    drafts = best[:, :K].clone()
    drafts[0, 0] = (drafts[0, 0] + 1) % V                        # rejected at once
    drafts[1, 2] = (drafts[1, 2] + 1) % V                        # two accepted
    lengths = torch.tensor([K, K, K, 2])                         # row 3: two drafts, both right
    ints, floats, paths = _packed([SamplingParams(temperature=0)] * 4, [0, 1, 2, 3], [9] * 4)
    res = accept(logits, drafts, lengths, None, ints, floats, paths)
    assert res.num_accepted.tolist() == [0, 2, K, 2]
    assert res.tokens[0, 0] == best[0, 0]
    assert res.tokens[1, :3].tolist() == best[1, :3].tolist()
    assert res.tokens[2].tolist() == best[2].tolist()            # all accepted: the bonus is the last row's argmax
    assert res.tokens[3, :3].tolist() == best[3, :3].tolist()    # bonus from row 2, past the row's real drafts


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=0.8, top_k=7), SamplingParams(temperature=1.2, top_k=1500),
                                    SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.0, min_p=0.2),
                                    SamplingParams(temperature=0.6, top_k=40, top_p=0.9, min_p=0.05)])
def test_filtered_probs_is_the_samplers_distribution(params):
    vocab = 2000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(11)) * 3
    ints, floats, paths = _packed([params] * 3, [1, 2, 3], [0] * 3, vocab)
    got = filtered_probs(logits, ints, floats, paths)
    for r in range(3):
        torch.testing.assert_close(got[r].double(), reference_probs(logits[r], params), atol=1e-6, rtol=1e-4)


def test_seeded_row_same_alone_or_batched():
    g = torch.Generator().manual_seed(5)
    B = 6
    logits = torch.randn(B, K + 1, V, generator=g)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    drafts = torch.randint(0, V, (B, K), generator=g)
    lengths = torch.tensor([3, 1, 2, 3, 3, 2])
    params = [SamplingParams(temperature=t) for t in (0.5, 1.0, 0, 1.5, 0.9, 0.7)]
    ints, floats, paths = _packed(params, [10, 11, 12, 13, 14, 15], [3, 50, 7, 7, 1000, 2])
    batched = accept(logits, drafts, lengths, q, ints, floats, paths)
    for b in reversed(range(B)):
        i1, f1, p1 = _packed([params[b]], [10 + b], [ints[2, b].item()])
        alone = accept(logits[b:b + 1], drafts[b:b + 1], lengths[b:b + 1], q[b:b + 1], i1, f1, p1)
        n = alone.num_accepted.item()
        assert n == batched.num_accepted[b].item()
        assert alone.tokens[0, :n + 1].tolist() == batched.tokens[b, :n + 1].tolist()
