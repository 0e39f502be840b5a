"""The batched device sampler: draws follow the filtered distribution (chi-square against the plain reference),
greedy is argmax, a seeded row draws the same token alone or in any batch, sampling edge values never give NaN or
a stuck token, the grammar bitmask, logprobs; and a CUDA-only consistency and timing check."""

from __future__ import annotations

import time

import pytest
import torch

from kestrel.errors import RequestError
from kestrel.runtime import sampler as S
from kestrel.kernels.sampling.nucleus import ROUNDS, nucleus_draw
from kestrel.runtime.sampler import Sampler, draw, reference_probs, uniforms
from kestrel.sampling_params import SamplingParams
from helpers import compile_for_sm90

torch.set_num_threads(1)
V = 40


def _logits(seed: int, shape=(V,), scale: float = 2.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _draws(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 7, device="cpu") -> torch.Tensor:
    """n draws of one row (positions 0..n-1 of one seeded request), as one batch of n rows."""
    sm = Sampler(n, logits_row.shape[0], torch.device(device))
    row = sm.row(params, seed)
    flags = sm.prepare([row] * n, list(range(n)), None)
    return sm.sample(logits_row.to(device).expand(n, -1).contiguous(), flags).token_ids.cpu()


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of `samples` against `probs` (cells expected below 5 draws are pooled); also asserts that no
    zero-probability token was drawn."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, f"drew tokens the filters exclude: {torch.nonzero(counts * (probs == 0))}"
    exp = probs * n
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big & (probs > 0)].sum().reshape(1)])
    exp_c = torch.cat([exp[big], exp[~big & (probs > 0)].sum().reshape(1)])
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    if obs_c.numel() == 1:
        return 1.0
    stat = ((obs_c - exp_c) ** 2 / exp_c).sum()
    df = obs_c.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


CASES = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
    dict(temperature=2.0, top_k=3, top_p=0.5),
    dict(temperature=1.0, top_k=20),
]


@pytest.mark.parametrize("cap", [1024, 8])        # 8 < V: top-k rows take the torch.topk candidates
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_draws_follow_the_filtered_distribution(case, cap, monkeypatch):
    monkeypatch.setattr(S, "TOP_K_CAP", cap)
    params = SamplingParams(**case)
    x = _logits(CASES.index(case))
    ref = reference_probs(x, params)
    p = chi2_pvalue(_draws(x, params, 20000), ref)
    assert p > 1e-4, f"draws do not follow the filtered distribution (chi-square p = {p:.2e})"


def test_the_chi_square_check_can_fail():
    """The check itself: draws from the unfiltered distribution fail against a top-p reference."""
    x = _logits(3)
    draws = _draws(x, SamplingParams(temperature=1.0), 20000)
    with pytest.raises(AssertionError):
        assert chi2_pvalue(draws, reference_probs(x, SamplingParams(top_p=0.6))) > 1e-4
    assert chi2_pvalue(draws, reference_probs(x * 1.1, SamplingParams(temperature=1.0))) < 1e-4


def test_two_level_draw_matches_its_weights():
    w = torch.rand(V, generator=torch.Generator().manual_seed(1)) * (torch.arange(V) % 3 != 0)
    n = 30000
    u = uniforms(torch.full((n,), 12345), torch.full((n,), 678), torch.arange(n))
    for block in (4, 7, 1024):                     # several blocks, a padded last block, one block
        got = draw(w.expand(n, -1), u, block=block)
        assert chi2_pvalue(got, w.double() / w.sum()) > 1e-4, f"block {block}"


def test_uniforms_are_uniform_and_depend_only_on_seed_and_position():
    n = 100000
    k0, k1 = S.seed_keys(2024)
    u = uniforms(torch.full((n,), k0), torch.full((n,), k1), torch.arange(n))
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert chi2_pvalue((u * 50).long(), torch.full((50,), 1 / 50, dtype=torch.float64)) > 1e-4
    assert u.unique().numel() == n
    # the host (Python ints) and device (tensor) halves of the hash agree
    xs = [0, 1, 12345, 2 ** 31, 2 ** 32 - 1]
    assert S.mix32(torch.tensor(xs)).tolist() == [S.mix32(x) for x in xs]
    again = uniforms(torch.full((10,), k0), torch.full((10,), k1), torch.arange(500, 510))
    assert torch.equal(again, u[500:510])
    other = uniforms(*(torch.full((10,), k) for k in S.seed_keys(2025)), torch.arange(500, 510))
    assert not torch.equal(other, again)


MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
         SamplingParams(temperature=0.8, top_k=5, seed=2), SamplingParams(temperature=1.1, top_p=0.7, seed=3),
         SamplingParams(temperature=0.6, min_p=0.1, seed=4), SamplingParams(top_k=40, top_p=0.9, seed=5, logprobs=2),
         SamplingParams(temperature=1.0, top_k=100, seed=6)]


def _run_rows(rows: list[int], logits: torch.Tensor, positions: list[int], device="cpu") -> list[int]:
    sm = Sampler(len(rows), logits.shape[1], torch.device(device))
    flags = sm.prepare([sm.row(MIXED[r], MIXED[r].seed or 0) for r in rows], [positions[r] for r in rows], 2)
    return sm.sample(logits[rows].to(device), flags).token_ids.tolist()


@pytest.mark.parametrize("cap", [1024, 16])
def test_a_seeded_row_draws_the_same_alone_and_in_any_batch(cap, monkeypatch):
    monkeypatch.setattr(S, "TOP_K_CAP", cap)
    n, vocab = len(MIXED), 300
    for step in range(5):
        logits = _logits(step, (n, vocab))
        positions = [17 + step + 3 * r for r in range(n)]
        alone = [_run_rows([r], logits, positions)[0] for r in range(n)]
        assert alone[0] == int(logits[0].argmax())
        for rows in ([*range(n)], [*range(n)][::-1], [3, 1, 5], [6, 2, 2, 0, 4], [5, 0]):
            assert _run_rows(rows, logits, positions) == [alone[r] for r in rows], (step, rows)


def test_greedy_is_argmax_and_the_bitmask_is_honoured():
    B, vocab = 6, 100
    logits = _logits(11, (B, vocab))
    sm = Sampler(B, vocab, torch.device("cpu"))
    greedy = SamplingParams(temperature=0)
    flags = sm.prepare([sm.row(greedy, 0)] * B, [5] * B, None)
    assert sm.sample(logits, flags).token_ids.tolist() == logits.argmax(-1).tolist()
    allowed = torch.rand(B, vocab, generator=torch.Generator().manual_seed(2)) < 0.3
    allowed[:, 0] = True
    bits = torch.zeros(B, -(-vocab // 32) * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    words = (bits.view(B, -1, 32) << torch.arange(32)).sum(-1)
    mask = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)      # bit 31 is the sign bit
    assert sm.sample(logits, flags, mask).token_ids.tolist() == \
        logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()
    # sampled rows draw only allowed tokens; an all-ones mask changes nothing
    hot = SamplingParams(temperature=5.0, top_p=0.99)
    flags = sm.prepare([sm.row(hot, s) for s in range(B)], [9] * B, None)
    for pos in range(40):
        flags = sm.prepare([sm.row(hot, s) for s in range(B)], [pos] * B, None)
        got = sm.sample(logits, flags, mask).token_ids
        assert bool(allowed.gather(1, got.unsqueeze(1)).all())
    ones = torch.full((B, -(-vocab // 32)), -1, dtype=torch.int32)
    assert torch.equal(sm.sample(logits, flags, ones).token_ids, sm.sample(logits, flags).token_ids)


def test_logprobs_come_from_the_unfiltered_distribution():
    B, vocab = 4, 60
    logits = _logits(5, (B, vocab))
    sm = Sampler(B, vocab, torch.device("cpu"))
    params = SamplingParams(temperature=0.5, top_k=3, seed=1, logprobs=4)
    flags = sm.prepare([sm.row(params, s) for s in range(B)], [0] * B, 4)
    res = sm.sample(logits, flags)
    lp = logits.log_softmax(-1)
    got = S.unpack_logprobs(res.logprobs.tolist())
    tv, ti = lp.topk(4, -1)
    for b, (chosen, top) in enumerate(got):
        assert chosen == pytest.approx(float(lp[b, res.token_ids[b]]), abs=1e-6)
        assert [i for i, _ in top] == ti[b].tolist()
        assert [v for _, v in top] == pytest.approx(tv[b].tolist(), abs=1e-6)


# ---- edge values -----------------------------------------------------------------------------------------------
GREEDY_LIKE = [dict(temperature=1e-39), dict(temperature=5e-324), dict(temperature=1e-6), dict(temperature=1e-4),
               dict(top_p=1e-46), dict(top_p=5e-324), dict(top_p=1e-30), dict(min_p=1.0), dict(top_k=1),
               dict(temperature=1e-39, top_p=1e-46), dict(temperature=3.0, top_k=1, top_p=1e-40, min_p=1.0)]


@pytest.mark.parametrize("case", GREEDY_LIKE, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_tiny_values_behave_as_greedy(case):
    x = torch.linspace(-3, 3, V)[torch.randperm(V, generator=torch.Generator().manual_seed(4))]
    draws = _draws(x, SamplingParams(**case), 500)
    assert draws.unique().tolist() == [int(x.argmax())]


@pytest.mark.parametrize("case", [dict(temperature=1e30), dict(temperature=1e300), dict(temperature=3.4e38),
                                  dict(temperature=1e6, top_k=10 ** 9), dict(temperature=1e10, min_p=5e-324),
                                  dict(temperature=1e20, top_p=1.0, top_k=-1)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_huge_temperatures_sample_uniformly(case):
    x = _logits(9)
    draws = _draws(x, SamplingParams(**case), 20000)
    assert chi2_pvalue(draws, torch.full((V,), 1 / V, dtype=torch.float64)) > 1e-4


def test_large_top_k_is_off_and_denormal_min_p_is_almost_off():
    x = _logits(12)
    base = _draws(x, SamplingParams(temperature=0.9), 2000)
    for kw in (dict(top_k=V), dict(top_k=V + 1), dict(top_k=10 ** 12), dict(top_k=-1), dict(top_k=0)):
        assert torch.equal(_draws(x, SamplingParams(temperature=0.9, **kw), 2000), base), kw
    tiny = _draws(x, SamplingParams(temperature=0.9, min_p=1e-45), 20000)
    assert chi2_pvalue(tiny, reference_probs(x, SamplingParams(temperature=0.9))) > 1e-4


def test_masked_logits_and_extreme_scales_never_give_nan_or_token_zero():
    x = _logits(13, scale=1e4)                  # very peaked: exp underflows everywhere but the top
    x[0] = float("-inf")
    for kw in (dict(temperature=0.01), dict(temperature=0.5, top_p=0.3), dict(min_p=0.5), dict(top_k=3)):
        draws = _draws(x, SamplingParams(**kw), 300)
        assert bool((draws != 0).all()) and draws.unique().tolist() == [int(x.argmax())], kw
    flat = torch.zeros(V)
    draws = _draws(flat, SamplingParams(temperature=1e-3, top_p=0.5), 4000)
    assert chi2_pvalue(draws, reference_probs(flat, SamplingParams(temperature=1e-3, top_p=0.5))) > 1e-4


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", float("nan")),
                                         ("temperature", float("inf")), ("temperature", True), ("top_p", 0.0),
                                         ("top_p", -0.0), ("top_p", 1.0000001), ("top_p", float("nan")),
                                         ("min_p", -1e-9), ("min_p", 1.5), ("min_p", float("nan")),
                                         ("top_k", -2), ("top_k", True), ("top_k", 2.5)])
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


def test_engine_with_tiny_temperature_gives_the_greedy_tokens():
    from test_runtime_helpers import greedy, make_engine, run_to_end
    engine = make_engine("k3-tiny", max_num_seqs=4)
    prompt = list(range(5, 30))
    ids = [engine.add_request(prompt, greedy(8))]
    for kw in (dict(temperature=1e-39, seed=1), dict(temperature=0.7, top_p=1e-46, seed=2),
               dict(temperature=1.0, min_p=1.0, seed=3)):
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True, **kw)))
    run_to_end(engine)
    outs = [engine.final_output(i).token_ids for i in ids]
    assert all(o == outs[0] for o in outs[1:]), outs


# ---- on the GPU ------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_sampler_matches_the_distribution_and_is_batch_invariant():
    x = _logits(21)
    for case in CASES:
        params = SamplingParams(**case)
        assert chi2_pvalue(_draws(x, params, 20000, device="cuda"), reference_probs(x, params)) > 1e-4, case
    n, vocab = len(MIXED), 163840
    logits = _logits(22, (n, vocab)).to(torch.bfloat16)
    positions = list(range(100, 100 + n))
    alone = [_run_rows([r], logits, positions, "cuda")[0] for r in range(n)]
    assert alone[0] == int(logits[0].float().argmax())
    for rows in ([*range(n)], [*range(n)][::-1], [4, 2, 6]):
        assert _run_rows(rows, logits, positions, "cuda") == [alone[r] for r in rows]


@cuda
@pytest.mark.parametrize("kind", ["greedy", "temperature", "top_k", "top_p"])
def test_cuda_sampler_time_at_batch_64(kind):
    """One batched step at 64 x 163,840 (bf16 logits): no per-row work, so well under a few milliseconds.
    `benchmarks/sampler_bench.py` measures it properly."""
    params = {"greedy": SamplingParams(temperature=0), "temperature": SamplingParams(temperature=0.8),
              "top_k": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
              "top_p": SamplingParams(temperature=0.8, top_p=0.95)}[kind]
    B, vocab = 64, 163840
    logits = torch.randn(B, vocab, device="cuda").to(torch.bfloat16)
    sm = Sampler(B, vocab, torch.device("cuda"))
    rows = [sm.row(params, s) for s in range(B)]
    for _ in range(3):
        sm.sample(logits, sm.prepare(rows, [0] * B, None)).token_ids.tolist()
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 20
    for i in range(n):
        sm.sample(logits, sm.prepare(rows, [i] * B, None)).token_ids.tolist()
    ms = (time.perf_counter() - t0) / n * 1e3
    print(f"sampler {kind} batch 64: {ms:.3f} ms")
    assert ms < 5, f"{kind}: {ms:.2f} ms per batched step"


@cuda
def test_cuda_sampler_replays_from_a_graph():
    """Captured once over the persistent parameter buffers, a replay after `prepare` equals the eager call: every
    path, logprobs and a bitmask, with no host sync inside (capture would fail on one)."""
    n, vocab = len(MIXED), 163840
    logits = _logits(23, (n, vocab), scale=3.0).cuda().to(torch.bfloat16)
    mask = torch.full((n, vocab // 32), -1, dtype=torch.int32, device="cuda")
    mask[:, :100] = 0
    sm = Sampler(n, vocab, torch.device("cuda"))
    rows = [sm.row(p, p.seed or 0) for p in MIXED]
    flags = sm.prepare(rows, list(range(n)), 2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sm.sample(logits, flags, mask)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = sm.sample(logits, flags, mask)
    for step in range(5):
        assert sm.prepare(rows, [step * 11 + r for r in range(n)], 2) == flags
        graph.replay()
        eager = sm.sample(logits, flags, mask)
        assert torch.equal(res.token_ids, eager.token_ids) and torch.equal(res.logprobs, eager.logprobs)
        assert bool((res.token_ids >= 100).all())


# ---- the top-p / min-p kernel (kernels/sampling/nucleus.py) ----------------------------------------------------
def _order_keys(v: torch.Tensor) -> torch.Tensor:
    b = v.contiguous().view(torch.int32).long()
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF)


def nucleus_spec(x: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int],
                 rounds: int = ROUNDS, kept: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' algorithm in plain torch, all rows at once: rejection rounds (an exponential race over the keys
    at or above the k-th that min-p keeps, kept if top-k, top-p and min-p keep it), a second stage of rounds over the
    tokens ahead of the first one refused, then a draw over the reference's kept set (`kept`, if given, is that
    set)."""
    mix, M = S.mix32, S.MASK32
    B, V = x.shape
    T = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params])
    keys = torch.tensor([S.seed_keys(s) for s in seeds])
    h = mix(mix(torch.tensor(positions) ^ keys[:, 0]) ^ keys[:, 1])

    def u_of(a):
        return ((a >> 5) * (1 << 26) + (mix(a ^ 0x1B873593) >> 6)).double() * 2.0 ** -53

    v = x.float() / T + 0.0
    w = torch.exp(v - v.amax(-1, keepdim=True))
    k = _order_keys(v)
    ids = torch.arange(V)
    # the k-th largest key t_k; the proposals come from the keys >= t_k; the top-k mass counts t_k's ties up to k
    tk = k.sort(-1, descending=True).values.gather(1, (top_k - 1).clamp(max=V - 1).unsqueeze(1))
    has_k = (top_k < V).unsqueeze(1)
    above = k > tk
    zk = torch.where(has_k.squeeze(1), (w * above).sum(-1) + (top_k - above.sum(-1)) * w.gather(1, (k == tk).float()
                     .argmax(-1, keepdim=True)).squeeze(1), w.sum(-1))
    proposal = (~has_k | (k >= tk)) & (w >= min_p.unsqueeze(1))
    tok, done = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.bool)
    for stage in range(2 if rounds else 0):
        first_n, first_j = torch.full((B,), V), torch.zeros(B, dtype=torch.long)
        for r in range(stage * rounds, (stage + 1) * rounds):
            hr = mix((h + (r + 1) * 40503) & M).unsqueeze(1)
            t = (mix(hr ^ ids).float() + 0.5) * 2.0 ** -32
            e = torch.where(t < 0.015625, t * (1.0 + t * (0.5 + t * (0.33333334 + t * 0.25))), -torch.log(1.0 - t))
            j = torch.where(proposal, e * torch.exp(v.amax(-1, keepdim=True) - v), float("inf")).argmin(-1)
            kj = k.gather(1, j.unsqueeze(1))
            ahead = (k > kj) | ((k == kj) & (ids < j.unsqueeze(1)))
            before, n = (w * ahead).sum(-1), ahead.sum(-1)
            ok = (w.gather(1, j.unsqueeze(1)).squeeze(1) >= min_p) & (n < top_k) & \
                ((top_p >= 1) | (before < top_p * zk) | (n == 0))
            tok = torch.where(~done & ok, j, tok)
            first = ~ok & (n < first_n)
            first_j, first_n = torch.where(first, j, first_j), torch.where(first, n, first_n)
            done |= ok
        # stage 2: only the tokens ahead of stage 1's first refused candidate (all after it are refused too)
        kb = k.gather(1, first_j.unsqueeze(1))
        proposal &= (k > kb) | ((k == kb) & (ids < first_j.unsqueeze(1)))
    if kept is None:
        kept = torch.stack([reference_probs(x[b], params[b]) > 0 for b in range(B)])
    kw = (w * kept).double().cumsum(-1)
    u = u_of(mix(h ^ 0x2545F491))
    fb = torch.searchsorted(kw, (u * kw[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp(max=V - 1)
    return torch.where(done, tok, fb)


NUCLEUS_CASES = [dict(temperature=1.0, top_p=0.6), dict(temperature=0.7, top_p=0.95), dict(temperature=1.0, min_p=0.2),
                 dict(temperature=2.0, top_p=0.3, min_p=0.1), dict(top_p=1e-46), dict(temperature=0.5, top_p=0.999),
                 dict(temperature=1.5, top_p=0.05, min_p=0.9), dict(temperature=0.8), dict(temperature=1.0, top_k=5),
                 dict(temperature=0.8, top_k=20, top_p=0.7), dict(temperature=1.3, top_k=30, min_p=0.3),
                 dict(temperature=1.2, top_k=3, top_p=0.5, min_p=0.1), dict(temperature=2.0, top_k=1),
                 dict(temperature=3.0, top_p=0.02), dict(temperature=2.5, top_k=100, top_p=0.1)]   # to stage 2


@pytest.mark.parametrize("rounds", [ROUNDS, 0])     # 0: every row takes the bisection fallback
@pytest.mark.parametrize("case", NUCLEUS_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_nucleus_algorithm_draws_from_the_filtered_distribution(case, rounds):
    params = SamplingParams(**case)
    x = _logits(50 + NUCLEUS_CASES.index(case))
    n = 20000
    ref = reference_probs(x, params)
    got = nucleus_spec(x.expand(n, -1), [params] * n, [3] * n, list(range(n)), rounds, kept=(ref > 0).expand(n, -1))
    assert chi2_pvalue(got, ref) > 1e-4


def test_nucleus_kernel_follows_its_algorithm_and_finds_the_exact_boundary():
    """Interpreted on the CPU, compiled on a GPU: the kernels' tokens equal the torch statement of their algorithm,
    with the row in one chunk or split in several; forced to bisect, the boundary (key, ties kept) gives exactly the
    reference's kept set, ties, top-k and a tiny top_p included."""
    B, vocab = len(NUCLEUS_CASES), 150
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # interpreter on the CPU, sm_90 on a GPU
    xc = _logits(60, (B, vocab))
    xc[0, :30] = xc[0, 0]                        # a block of ties at the top
    xc[1] = (xc[1] * 4).round() / 4              # many ties everywhere
    xc[9] = (xc[9] * 2).round() / 2              # ties at the top-k boundary
    x = xc.to(dev)
    params = [SamplingParams(**c) for c in NUCLEUS_CASES]
    sm = Sampler(B, vocab, dev, nucleus_kernel=True)
    rows = [sm.row(p, 3) for p in params]
    positions = [10 + b for b in range(B)]
    flags = sm.prepare(rows, positions, None)
    assert flags.paths == {S.NUCLEUS, S.PLAIN, S.TOP_K}
    want = nucleus_spec(xc, params, [3] * B, positions).tolist()
    assert sm.sample(x, flags).token_ids.tolist() == want
    plain = [SamplingParams(temperature=t) for t in (0.5, 1.0, 3.0)]          # temperature only, no top-k launches
    pflags = sm.prepare([sm.row(p, 3) for p in plain], positions[:3], None)
    assert pflags.paths == {S.PLAIN}
    assert sm.sample(x[:3], pflags).token_ids.tolist() == nucleus_spec(xc[:3], plain, [3] * 3, positions[:3]).tolist()
    flags = sm.prepare(rows, positions, None)
    ints, floats = sm.ints[:, :B], sm.floats[:, :B]
    which = tuple(sorted(flags.paths))
    out = torch.full((B,), -1, device=dev)
    thr = nucleus_draw(x, ints, floats[0], floats[1], floats[2], which, out, block=64, fallback_block=64)
    assert out.tolist() == want                  # three chunks per row: the same tokens
    assert int((thr[:, 0] == -1).sum()) >= B // 2, thr.tolist()          # most rows take a rejection round
    assert int((thr[:, 1] > ROUNDS).sum() + (thr[:, 0] != -1).sum()) >= 1, thr.tolist()     # some go further
    thr = nucleus_draw(x, ints, floats[0], floats[1], floats[2], which, out, rounds=0, block=64, fallback_block=64)
    assert out.tolist() == nucleus_spec(xc, params, [3] * B, positions, rounds=0).tolist()
    for b, p in enumerate(params):
        v = xc[b] / p.temperature + 0.0
        k, (t, c) = _order_keys(v), thr[b].cpu().tolist()
        tie = k == t
        kept = ((k > t) | (tie & (tie.long().cumsum(0) <= c))) & (torch.exp(v - v.max()) >= p.min_p)
        assert torch.equal(kept, reference_probs(xc[b], p) > 0), NUCLEUS_CASES[b]


def _canonical_top_k(v: torch.Tensor, k: int) -> torch.Tensor:
    """The first k tokens of the canonical order (key descending, id ascending), as a mask."""
    keys = _order_keys(v)
    ids = torch.arange(v.numel())
    order = sorted(range(v.numel()), key=lambda j: (-int(keys[j]), int(ids[j])))
    kept = torch.zeros(v.numel(), dtype=torch.bool)
    kept[order[:k]] = True
    return kept


def _top_k_rows(vocab: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Rows for the top-k threshold: random, ties at and around the k-th key, a flat row, masked tokens, bf16
    values, keys apart only in their last bits; k = 1, small, V - 1, V and above V, with top-p and min-p beside;
    the radix search ends on a full bin, on a single key, after one digit or after all four."""
    x = _logits(80, (14, vocab))
    x[2] = (x[2] * 2).round() / 2                          # ties everywhere, the k-th among them
    x[3] = 1.25                                            # every key tied
    x[4, ::2] = float("-inf")                              # masked tokens
    x[5] = (x[5] * 3).bfloat16().float()                   # the benchmark's class: bf16 logits
    x[6, :] = torch.rand(vocab) - 2                        # the top 10: five tied at 3, five tied at 2 (all in)
    x[6, 7:12], x[6, vocab - 5:] = 3.0, 2.0
    x[7, 100:140] = x[7].max() + 1                          # 40 ties at the top, k inside them
    near = (torch.tensor(1.5).view(torch.int32) + torch.arange(20, dtype=torch.int32) % 5).view(torch.float32)
    x[12:] = -x[12:].abs() - 1
    x[12:, 50:70] = near                    # 5 keys 4 times each, apart only in the last bits: all four digits
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.9, top_k=7, top_p=0.8,
                                                                      min_p=0.05),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.9), SamplingParams(temperature=0.7, top_k=50),
              SamplingParams(temperature=1.0, top_k=10, min_p=0.01),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.95), SamplingParams(temperature=1.0, top_k=10),
              SamplingParams(temperature=1.3, top_k=25, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=vocab - 1, min_p=0.1),
              SamplingParams(temperature=0.6, top_k=vocab - 1), SamplingParams(temperature=1.0, top_k=vocab, top_p=0.7),
              SamplingParams(temperature=1.1, top_k=vocab + 5, min_p=0.2),
              SamplingParams(temperature=1.0, top_k=10), SamplingParams(temperature=1.0, top_k=12, top_p=0.9)]
    return x, params


# every chunk histogrammed / every key added one by one; the stats pass's windowed first digit, or with a window of
# one bin nearly every row handed to the whole-histogram pass
@pytest.mark.parametrize("sparse,window", [(0, None), (64, None), (0, 1)])
def test_nucleus_top_k_threshold_is_exact_and_tokens_follow_the_algorithm(sparse, window):
    """Interpreted on the CPU (compiled on a GPU): per top-k row the radix select's threshold (t, ties kept) gives
    exactly the canonical first k tokens, the search ending early or running all four digits, over a vocabulary
    split in chunks of which the last is partial; the tokens equal the torch statement of the algorithm (rows with
    k >= V run the same launches without top-k), and the radix workspace is left reset for the next call."""
    from kestrel.kernels.sampling.nucleus import NucleusWork
    vocab = 300                                              # 5 chunks of 64, the last of 44
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    xc, params = _top_k_rows(vocab)
    B = len(params)
    sm = Sampler(B, vocab, dev, nucleus_kernel=True)
    positions = [30 + b for b in range(B)]
    flags = sm.prepare([sm.row(p, 9) for p in params], positions, None)
    ints, floats = sm.ints[:, :B].clone(), sm.floats[:, :B]
    ints[3] = torch.tensor([p.top_k for p in params])       # k = V and k > V reach the kernels as they are
    ints[4] = S.TOP_K
    which = tuple(sorted(flags.paths | {S.TOP_K}))
    work = NucleusWork.allocate(B, vocab, dev, min_block=64)
    want = nucleus_spec(xc, params, [9] * B, positions).tolist()
    out = torch.full((B,), -1, device=dev)
    nucleus_draw(xc.to(dev), ints, floats[0], floats[1], floats[2], which, out, block=64, fallback_block=64,
                 work=work, sparse=sparse, **({} if window is None else dict(window=window)))
    assert out.tolist() == want
    assert torch.equal(work.hist, NucleusWork.allocate(B, vocab, dev, min_block=64).hist)    # reset for the next
    early = 0
    for b, p in enumerate(params):
        if p.top_k >= vocab:
            continue
        v = xc[b] / p.temperature + 0.0
        keys, (t, c) = _order_keys(v), work.kth[b, :2].cpu().tolist()
        tie = keys == t
        kept = (keys > t) | (tie & (tie.long().cumsum(0) <= c))
        assert torch.equal(kept, _canonical_top_k(v, p.top_k)), (b, p)
        early += c == 0
    assert 1 <= early <= B - 5, work.kth.tolist()            # both endings of the search are covered


def test_top_k_first_digit_below_the_window_is_counted_whole():
    """The stats pass counts each chunk's first digit in the window below its own largest key only. A row whose k-th
    key lies below the window of a chunk with a far larger key (1e4 among values near 1: that chunk's keys near 1
    are not counted, the other chunks' are) must go to the whole-histogram pass: the windowed counts would place
    the first digit too low. Also k-th keys of every sign and size beside it, and the workspace left reset."""
    from kestrel.kernels.sampling.nucleus import NucleusWork
    vocab, B = 300, 4
    g = torch.Generator().manual_seed(93)
    x = torch.rand(B, vocab, generator=g) * 1.5 + 0.5       # first digit 191 (keys in [0.5, 2))
    x[:2, 64:] = x[:2, 64:] / 4                              # 190 past the first chunk of 64
    x[:2, 3] = 1e4                                           # 198: the first chunk counts 195..198 only
    x[2] = -x[2]                                             # every key negative
    x[3, 200] = 1e4
    ks = [50, 250, 40, 299]             # row 0's 50th key is in the first chunk (digit 191), whose 191s are uncounted
    params = [SamplingParams(temperature=1.0, top_k=k) for k in ks]
    sm = Sampler(B, vocab, torch.device("cpu"), nucleus_kernel=True)
    flags = sm.prepare([sm.row(p, 9) for p in params], [3] * B, None)
    work = NucleusWork.allocate(B, vocab, torch.device("cpu"), min_block=64)
    out = torch.full((B,), -1)
    nucleus_draw(x, sm.ints[:, :B], *sm.floats[:, :B], tuple(sorted(flags.paths)), out, block=64,
                 fallback_block=64, work=work)
    for b, k in enumerate(ks):
        keys, (t, c) = _order_keys(x[b] + 0.0), work.kth[b, :2].tolist()
        tie = keys == t
        kept = (keys > t) | (tie & (tie.long().cumsum(0) <= c))
        assert torch.equal(kept, _canonical_top_k(x[b] + 0.0, k)), (b, k, t, c)
    assert torch.equal(work.hist, NucleusWork.allocate(B, vocab, torch.device("cpu"), min_block=64).hist)


def _check_top_k_thresholds(dev: torch.device, B: int, vocab: int, block: int | None = None, seed: int = 90,
                            work=None) -> None:
    """`nucleus_draw` on bf16 logits (the benchmark's class), k from 1 to V - 1 with ties, flat and fp32 rows
    among them: every row's threshold (t, c) keeps exactly the canonical first k (c > 0: t is the k-th key and c
    of its ties are in; c = 0: exactly k keys lie above t); the per-row tickets are left at zero."""
    from kestrel.kernels.sampling.nucleus import NucleusWork
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, vocab, generator=g) * 3).bfloat16()
    x[1] = x[1].float().round().bfloat16()                              # heavy ties
    x[2] = 0.5                                                          # flat
    ks = torch.tensor([1, 50, 50, 1000, vocab - 1, 2, 20, 300] * (-(-B // 8)))[:B]
    sm = Sampler(B, vocab, dev, nucleus_kernel=True)
    params = [SamplingParams(temperature=0.8, top_k=int(k), top_p=0.95) for k in ks]
    flags = sm.prepare([sm.row(p, s) for s, p in enumerate(params)], [5] * B, None)
    work = work or NucleusWork.allocate(B, vocab, dev, min_block=block or 256)
    out = torch.full((B,), -1, device=dev)
    ints, floats = sm.ints[:, :B], sm.floats[:, :B]
    xd = x.to(dev)
    nucleus_draw(xd, ints, floats[0], floats[1], floats[2], tuple(sorted(flags.paths)), out, block=block, work=work)
    keys = _order_keys(xd.float() / floats[0].unsqueeze(1) + 0.0)
    kd = ks.to(dev)
    tk = keys.sort(-1, descending=True).values.gather(1, (kd - 1).unsqueeze(1)).squeeze(1)
    t, c = work.kth[:B, 0].long(), work.kth[:B, 1].long()
    above = (keys > t.unsqueeze(1)).sum(-1)
    assert bool(((c == 0) | (t == tk)).all()), (t.tolist(), tk.tolist())
    assert torch.equal(above + c, kd), (above.tolist(), c.tolist())
    assert bool(((out >= 0) & (keys.gather(1, out.unsqueeze(1)).squeeze(1) >= tk)).all())    # tokens in the top k
    assert not work.tick.any(), work.tick.tolist()


def test_top_k_thresholds_are_settled_by_the_last_program_of_each_row():
    """Interpreted on the CPU (programs one after another): each top-k launch's last program of a row (by its
    ticket) settles the search, so a wrong ticket (the first program, a count off by one, a ticket not reset)
    settles on histograms missing chunks and the threshold differs from the sort's. 18 chunks of 64 (the last of
    12) in 5 radix programs of 4 (the last with 2), k from 1 to V - 1 with ties, twice on one workspace."""
    from kestrel.kernels.sampling.nucleus import NucleusWork
    B, vocab = 6, 1100
    work = NucleusWork.allocate(B, vocab, torch.device("cpu"), min_block=64)
    for seed in (91, 92):
        _check_top_k_thresholds(torch.device("cpu"), B, vocab, block=64, seed=seed, work=work)


@cuda
def test_cuda_top_k_thresholds_at_batch_64():
    _check_top_k_thresholds(torch.device("cuda"), 64, 163840)


@cuda
def test_cuda_kernels_draw_from_the_filtered_distribution():
    """On the device, every case with the row in one chunk or in three, by the rejection rounds and by the fallback
    alone: chi-square against the reference."""
    n = 20000
    for i, case in enumerate(NUCLEUS_CASES + CASES):
        params = SamplingParams(**case)
        x = _logits(70 + i)
        sm = Sampler(n, V, torch.device("cuda"), nucleus_kernel=True)
        flags = sm.prepare([sm.row(params, 5)] * n, list(range(n)), None)
        xs = x.cuda().expand(n, -1).contiguous()
        for kw in (dict(), dict(block=16), dict(rounds=0, block=16, fallback_block=16)):
            out = torch.full((n,), -1, device="cuda")
            nucleus_draw(xs, sm.ints[:, :n], *sm.floats[:, :n], tuple(sorted(flags.paths)), out, **kw)
            p = chi2_pvalue(out.cpu(), reference_probs(x, params))
            assert p > 1e-4, (case, kw, p)


_COMPILE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kestrel.kernels.sampling import nucleus as N

I32 = ("hist_ptr", "kth_ptr", "tick_ptr", "cj_ptr", "an_ptr", "rowj_ptr")
I64 = ("ints_ptr", "out_ptr", "thr_ptr")


def compile_one(kernel, const, warps):
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16" if name == "x_ptr" else "*i32" if name in I32 else "*i64" if name in I64 else "*fp32"
        else:
            sig[name] = "i32"
    src = ASTSource(fn=kernel, signature=sig, constexprs=const)
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"]


n = 0
for top_k in (False, True):            # the paths a launch serves are a runtime argument (`paths`, i32)
    for block, warps in ((256, 4), (2048, 8)):
        compile_one(N._stats_kernel, dict(TOP_K=top_k, WINDOW=N.FIRST_DIGIT_WINDOW, BLOCK=block), warps)
        n += 1
        for R in (N.ROUNDS, 0) if block == 2048 else (N.ROUNDS,):      # R = 0: the tests' forced fallback
            for stage in (1, 2) if R else (1,):
                compile_one(N._ahead_kernel, dict(TOP_K=top_k, STAGE=stage, R=R, CP2=16 if block == 256 else 128,
                                                  BLOCK=block), warps)
                compile_one(N._decide_kernel, dict(TOP_K=top_k, STAGE=stage, R=R,
                                                   CP2=16 if block == 256 else 128), 4)
                n += 2
        if top_k:
            compile_one(N._first_digit_kernel, dict(SUB=N.RADIX_SUB, BLOCK=block), warps)
            n += 1
            for d in (1, 2, 3):
                compile_one(N._radix_kernel, dict(D=d, SPARSE=N.SPARSE_KEYS, SUB=N.RADIX_SUB, BLOCK=block),
                            warps)
            n += 3
        for stage in (1, 2):
            compile_one(N._proposal_kernel, dict(TOP_K=top_k, STAGE=stage, R=N.ROUNDS,
                                                 CP2=16 if block == 256 else 128, BLOCK=block), warps)
            n += 1
compile_one(N._fallback_kernel, dict(BLOCK=4096), 8)
print("cubins", n + 1)
"""


def test_nucleus_kernel_compiles_for_the_h200():
    """The interpreter runs the kernels as Python; this compiles them for sm_90 as the sampler launches them (no
    GPU needed; a process without TRITON_INTERPRET), so control flow the compiler rejects is caught on the CPU."""
    assert "cubins" in compile_for_sm90(_COMPILE, fp_fusion=True)


# ---- no JIT on the serving path: the paths a launch serves are a runtime argument, warmed at start-up ----------
def _kernels():
    from helpers import sampler_kernels
    from kestrel.kernels.sampling import nucleus as N
    return N, sampler_kernels()


def _do_not_specialize(kernel) -> list:
    """The names or indices a kernel was declared with (a JITFunction keeps them; the interpreter's its kwargs)."""
    got = getattr(kernel, "do_not_specialize", None)
    return list(got if got is not None else kernel.kwargs.get("do_not_specialize") or ())


def test_the_paths_of_a_launch_are_a_runtime_argument_not_a_constexpr():
    """Every kernel takes the set of paths as one unspecialized integer `paths` (a bit mask), no constexpr per
    path; so Triton compiles one variant per kernel whatever paths a step mixes."""
    import inspect
    import triton.language as tl
    N, kernels = _kernels()
    assert len(kernels) == 7
    for name, kernel in kernels.items():
        params = inspect.signature(kernel.fn).parameters
        assert not {"P0", "P1", "P2", "P3"} & set(params), name
        assert "paths" in params and params["paths"].annotation is not tl.constexpr, name
        assert "paths" in _do_not_specialize(kernel), name
    assert N.path_mask((S.NUCLEUS,)) == 16 and N.path_mask((S.PLAIN, S.TOP_K, S.TOP_K)) == 3
    with pytest.raises(ValueError):
        N.path_mask(())


class _Launches:
    """Stands in for a kernel: records each launch (grid, positional and keyword arguments), runs nothing."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.name, grid, args, kw))


@pytest.mark.parametrize("top_k", [False, True])
def test_launches_for_different_path_sets_differ_in_the_mask_alone(top_k, monkeypatch):
    """`nucleus_draw` for different sets of paths makes the same launches (grids, constexprs, integer arguments)
    but for the value of `paths`: the same compiled variants serve them."""
    import inspect
    N, kernels = _kernels()
    B, vocab = 5, 300
    x = _logits(3, (B, vocab))
    ints = torch.zeros(5, B, dtype=torch.int64)
    floats = torch.ones(3, B)
    work = N.NucleusWork.allocate(B, vocab, "cpu", min_block=N.chunk_block(vocab))
    out = torch.zeros(B, dtype=torch.int64)
    seen = {}
    for which in ((S.NUCLEUS,), (S.PLAIN,), (S.PLAIN, S.TOP_K, S.SORTED, S.NUCLEUS), (S.TOP_K,)):
        calls = []
        for name in kernels:
            monkeypatch.setattr(N, name, _Launches(name, calls))
        N.nucleus_draw(x, ints, *floats, which, out, top_k=top_k, work=work)
        shape = []
        for name, grid, args, kw in calls:
            at = list(inspect.signature(kernels[name].fn).parameters).index("paths")
            assert args[at] == N.path_mask(which), (name, which)
            shape.append((name, grid, kw, [a for i, a in enumerate(args) if i != at and not torch.is_tensor(a)]))
        seen[which] = shape
    first, *rest = seen.values()
    assert len(first) == (6 if top_k else 2) + 3 * 2 and all(s == first for s in rest)


def test_warm_up_covers_every_path_and_does_nothing_on_the_cpu(monkeypatch):
    """The warm-up's batches: one without top-k rows, one with (the two TOP_K variants), every path among them and
    a row that reaches the fallback; on the CPU (interpreter) it launches nothing."""
    sm = Sampler(4, 163840, torch.device("cpu"), nucleus_kernel=True)
    groups = [[sm.row(p, 0)[0][3] for p in g] for g in sm.warm_up_rows()]
    assert len(groups) == 2 and not {S.TOP_K, S.SORTED} & set(groups[0]) and {S.TOP_K, S.SORTED} <= set(groups[1])
    assert {S.PLAIN, S.TOP_K, S.SORTED, S.GREEDY, S.NUCLEUS} == set(groups[0]) | set(groups[1])
    assert any(p.top_p < 1e-3 for p in sm.warm_up_rows()[0])           # refused by every round: the fallback
    monkeypatch.setattr(S, "nucleus_draw", lambda *a, **k: pytest.fail("the CPU warm-up launched a kernel"))
    assert sm.warm_up() == 0.0


@cuda
def test_cuda_sampler_compiles_nothing_after_warm_up():
    """`Sampler.warm_up` compiles every variant of the sampler's kernels (SAMPLER_VARIANTS); after it, sampling
    batches of every mix of paths and batch sizes (top-p only, top-k only, min-p, greedy and plain rows beside
    sampled ones, a top-k above TOP_K_CAP, a bitmask) compiles no Triton kernel (the post-compile hook sees none)."""
    from helpers import SAMPLER_VARIANTS, forget_compiled_sampler_kernels, triton_compiles
    vocab, n = 163840, 64
    sm = Sampler(n, vocab, torch.device("cuda"))
    forget_compiled_sampler_kernels()
    with triton_compiles() as warm:
        sm.warm_up()
    assert len(warm) == SAMPLER_VARIANTS and len(set(warm)) == 7, warm
    mixes = [[SamplingParams(temperature=0.8, top_p=0.95)], [SamplingParams(temperature=1.0, top_k=50)],
             [SamplingParams(temperature=1.0, min_p=0.1)], MIXED,
             [SamplingParams(temperature=0), SamplingParams(temperature=0.7), SamplingParams(top_p=0.9)],
             [SamplingParams(temperature=0), SamplingParams(top_k=20, top_p=0.8)],
             [SamplingParams(top_k=4000), SamplingParams(temperature=0.9)], [SamplingParams(top_p=1e-6)]]
    with triton_compiles() as compiled:
        for i, mix in enumerate(mixes):
            for B in (1, 7, n):
                rows = [sm.row(mix[r % len(mix)], r) for r in range(B)]
                logits = _logits(100 + i, (B, vocab), scale=3.0).cuda()
                flags = sm.prepare(rows, list(range(B)), None)
                mask = torch.full((B, vocab // 32), -1, dtype=torch.int32, device="cuda") if i == 3 else None
                sm.sample(logits, flags, mask)
        torch.cuda.synchronize()
    assert not compiled, f"{len(compiled)} Triton kernels compiled after the warm-up: {compiled}"
