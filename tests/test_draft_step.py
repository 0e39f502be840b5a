"""The drafter's fused Markov step (catalog spec.draft_step.DraftStep) beyond its cells: the tokens of sampled rows
follow the q it returns, greedy ties go to the lowest id, ids of zero weight are never drawn, the strided outputs'
other rows stay untouched, and bad inputs are refused. On the CPU the Triton kernels run under the interpreter."""

import torch

from kestrel.catalog._op import validating
from kestrel.catalog.spec.draft_step import DraftStep
from test_runtime_sampler import chi2_pvalue

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _step(base, bias, temps, u, block=None):
    R, V = base.shape
    tokens = torch.full((R, 2), -7, dtype=torch.int64, device=base.device)
    probs = torch.full((R, 2, V), -7.0, device=base.device)
    with validating(DraftStep):
        DraftStep.raw_call(base, bias, temps, u, tokens[:, 1], probs[:, 1])
    assert (tokens[:, 0] == -7).all() and (probs[:, 0] == -7.0).all()      # the other step's rows untouched
    return tokens[:, 1], probs[:, 1]


def test_sampled_tokens_follow_q():
    g = torch.Generator().manual_seed(4)
    V, n = 40, (20000 if DEVICE == "cuda" else 600)      # the interpreter runs ~4 ms a program
    row = torch.randn(V, generator=g) * 2
    row[7] = float("-inf")                                     # a token of zero weight
    base = row.to(DEVICE).expand(n, V).contiguous()
    u = torch.rand(n, generator=g, dtype=torch.float64).to(DEVICE)
    tok, probs = _step(base, None, torch.full((n,), 1.3, device=DEVICE), u)
    q = torch.softmax(row.double() / 1.3, -1)
    torch.testing.assert_close(probs[0].double().cpu(), q, rtol=1e-5, atol=1e-8)
    assert chi2_pvalue(tok.cpu(), q) > 1e-4                    # also: token 7 never drawn


def test_greedy_ties_take_the_lowest_id_across_chunks():
    V = 9000
    base = torch.randn(2, V, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    base[:, [5000, 8100]] = 50.0                               # tied maxima in the second and third chunks
    base[1, 300] = 50.0                                        # and in the first for row 1
    bias = torch.zeros(2, V, device=DEVICE)
    tok, probs = _step(base, bias, torch.zeros(2, device=DEVICE), torch.rand(2, dtype=torch.float64).to(DEVICE))
    assert tok.tolist() == [5000, 300]
    assert torch.equal(probs.cpu(), torch.nn.functional.one_hot(tok.cpu(), V).float())


def test_invalid_inputs_are_refused():
    import pytest
    from kestrel.catalog._op import InvalidInput
    base = torch.randn(2, 100, device=DEVICE)
    tokens, probs = torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.zeros(2, 100, device=DEVICE)
    u = torch.rand(2, dtype=torch.float64, device=DEVICE)
    with validating(DraftStep), pytest.raises(InvalidInput, match="u must be fp64"):
        DraftStep.raw_call(base, None, torch.ones(2, device=DEVICE), u.float(), tokens, probs)
    with validating(DraftStep), pytest.raises(InvalidInput, match="overlaps"):
        DraftStep.raw_call(base, None, torch.ones(2, device=DEVICE), u, tokens, base)
