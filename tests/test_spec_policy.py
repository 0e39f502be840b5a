"""The n-gram lookup and the speculation policy's break-even rule, on their own."""

from __future__ import annotations

from types import SimpleNamespace

from kestrel.config import SpeculativeConfig
from kestrel.sampling_params import SamplingParams
from kestrel.spec.ngram import NgramProposer, ngram_lookup
from kestrel.spec.policy import PROBE_EVERY, REMEASURE_EVERY, SpecPolicy, size_bucket
from kestrel.spec.proposer import DraftInput


def test_ngram_lookup_longest_latest_match():
    assert ngram_lookup([1, 2, 3, 4, 5, 1, 2, 3], 3, 5, 2) == [4, 5, 1]
    assert ngram_lookup([7, 1, 2, 8, 9, 1, 2, 6, 6, 1, 2], 2, 5, 2) == [6, 6]        # the latest occurrence
    assert ngram_lookup([5, 1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 5, 2) == [9, 2]        # the longest suffix wins
    assert ngram_lookup([1, 2, 3, 9, 1, 2], 4, 5, 2) == [3, 9, 1, 2]
    assert ngram_lookup([1, 2, 3, 4, 1, 2], 8, 5, 2) == [3, 4, 1, 2]                 # fewer than K follow
    assert ngram_lookup([1, 2, 3, 4], 3, 5, 2) == []
    assert ngram_lookup([4, 1, 4], 3, 5, 2) == [] and ngram_lookup([4, 1, 4], 3, 5, 1) == [1, 4]
    assert ngram_lookup([1], 3, 5, 1) == []


def test_ngram_proposer_lengths():
    p = NgramProposer(3, 4, 2)
    block = p.propose([DraftInput([1, 2, 3, 4, 1, 2], 5, 0, 0, 0.0), DraftInput([9, 8, 7], 2, 1, 0, 0.0)])
    assert block.tokens.shape == (2, 3) and block.lengths == [3, 0] and block.probs is None
    assert block.tokens[0].tolist() == [3, 4, 1]


def _req(rid="r", out=0, max_tokens=100, **params):
    return SimpleNamespace(request_id=rid, params=SamplingParams(max_tokens=max_tokens, **params), grammar=None,
                           output_token_ids=[0] * out, num_tokens=10 + out, max_len=1000)


def test_break_even_rule():
    pol = SpecPolicy(SpeculativeConfig("ngram", 4, ema=1.0))
    r = _req()
    pol.begin_step(1)
    assert pol.draft_len(r) == 4                   # nothing measured: speculate to measure the verify step
    pol.record_step(True, 1, 0.030, 0.002)
    pol.begin_step(1)
    assert pol.draft_len(r) == 0                   # verify time known, decode time not: a plain step measures it
    pol.record_step(False, 1, 0.020)
    assert abs(pol.break_even(1) - (0.030 + 0.002) / 0.020) < 1e-12     # L* = (t_verify + t_draft) / t_decode = 1.6
    pol.record_acceptance("r", 1)                  # L = 2 >= 1.6: on
    pol.begin_step(1)
    assert pol.draft_len(r) == 4
    pol.record_acceptance("r", 0)                  # L = 1 < 1.6: off, probed again every PROBE_EVERY steps
    offs = []
    for _ in range(PROBE_EVERY):
        pol.begin_step(1)
        offs.append(pol.draft_len(r))
    assert offs.count(4) >= 1 and offs.count(0) >= PROBE_EVERY - 2
    # another batch size has its own times; the drafts never run past max_tokens or the context
    pol.begin_step(3)
    assert size_bucket(3) == 4 and pol.break_even() is None
    assert pol.draft_len(_req("s", out=97)) == 2
    assert pol.draft_len(_req("g", logprobs=1)) == 0
    assert size_bucket(1) == 1 and size_bucket(2) == 2 and size_bucket(5) == 8


def test_batch_size_limit_enforce_and_remeasure():
    pol = SpecPolicy(SpeculativeConfig("ngram", 3, disable_by_batch_size=4))
    pol.begin_step(5)
    assert pol.draft_len(_req()) == 0
    pol.begin_step(4)
    assert pol.draft_len(_req()) == 3
    pinned = SpecPolicy(SpeculativeConfig("ngram", 3, enforce=True, disable_by_batch_size=4))
    pinned.record_step(True, 8, 1.0)
    pinned.record_step(False, 8, 0.001)
    pinned.record_acceptance("r", 0)
    pinned.begin_step(8)
    assert pinned.draft_len(_req()) == 3           # enforce: on whatever the measurements say
    pol = SpecPolicy(SpeculativeConfig("ngram", 3, ema=1.0))
    pol.record_step(True, 1, 0.01)
    pol.record_step(False, 1, 0.02)                # verify cheaper than decode: always on ...
    plain = 0
    for _ in range(2 * REMEASURE_EVERY):
        pol.begin_step(1)
        plain += pol.draft_len(_req()) == 0
    assert plain == 2                              # ... but for the plain step that keeps t_decode fresh


def test_acceptance_estimate_starts_from_a_prior():
    pol = SpecPolicy(SpeculativeConfig("ngram", 4, ema=0.1))
    pol.record_acceptance("a", 0)                  # prior 1 + K/2 = 3 as one pseudo-block, then the mean
    assert pol.accept_len["a"] == 2.0
    pol.record_acceptance("a", 0)
    assert abs(pol.accept_len["a"] - 5 / 3) < 1e-12
    pol.record_acceptance("b", 4)                  # a new request starts from the average over all blocks
    first = 1.0 + 0.1 * (1.0 - 1.0)                # all-request EMA after a's two blocks: 1.0
    assert abs(pol.accept_len["b"] - (first + 0.5 * (5.0 - first))) < 1e-12
    pol.forget("a")
    assert "a" not in pol.accept_len
