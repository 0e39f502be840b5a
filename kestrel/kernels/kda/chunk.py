"""KDA chunked prefill: the recurrence of `recurrent.py` for long varlen segments, in chunks of BT = 64 tokens.

Math (per request, head and chunk; S0 the state entering the chunk, G = within-chunk cumsum of g, Gn = G[last]):
    the recurrence is S_t = (I - b_t k_t k_t^T) diag(exp g_t) S_{t-1} + b_t k_t v_t^T. Unrolled over a chunk,
    S_t = diag(exp G_t) S0 + sum_{s<=t} diag(exp(G_t - G_s)) k_s u_s^T with pseudo-values u_s satisfying
        (I + diag(b) Akk) U = diag(b) (V - (K * exp G) S0),   Akk[t, s] = sum_d k_td k_sd exp(G_td - G_sd), s < t
    so with T = (I + diag(b) Akk)^-1 diag(b) (the UT / WY form), W = T (K * exp G) and U~ = T V:
        U      = U~ - W S0
        O      = (Q * exp G) S0 + Aqk U,            Aqk[t, s] = sum_d q_td k_sd exp(G_td - G_sd), s <= t
        S_next = diag(exp Gn) S0 + (K * exp(Gn - G))^T U
Every exponent above is <= 0 (g <= 0), so nothing overflows however strong the decay. Akk / Aqk are built in
16-token sub-chunks: against keys of earlier sub-chunks through the reference point P = G just before the
sub-chunk, exp(G_t - G_s) = exp(G_t - P) exp(P - G_s) with both factors <= 1 (a tensor-core dot); within a
sub-chunk with the exact pairwise exponent ([16, 16, d-slice] tensors).

Three launches, none of which reads a host value (chunk bookkeeping stays on the device):
    1. intra  (chunk, head, sub-chunk): Akk and Aqk rows into [T, H, BT] fp32 scratch
    2. solve  (chunk, head): T by forward substitution in the 16x16 diagonal blocks and a block merge, then
       everything state-independent: W, U~, Q * exp G, K * exp(Gn - G) ([T, H, D] fp32 scratch), exp Gn
    3. state  (request, head, 32-wide v-tile): walks the request's chunks in order with its [D, BV] state slice
       in registers (4 dots a chunk), writes O, and stores the final state back to the pool slot.
Scratch: T * H * (4 D + 2 BT) fp32 (640 MiB for 8192 tokens x 32 heads x 128). Chunks never cross requests:
a request of n tokens owns ceil(n / BT) chunks, numbered through `chunk_cu`, and launches 1 and 2 run over an
upper bound T // BT + B of chunk programs (the spare ones return at once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.kda._common import _sum_combine, dot_precision

CHUNK = 64          # tokens per chunk
SUB = 16            # tokens per sub-chunk (the exact-exponent diagonal blocks)
STATE_STAGES = 2    # software-pipeline depth of the sequential pass (3 stages overflow shared memory at D=128)


@triton.jit(do_not_specialize=["B"])        # B changes every step; BLOCK_B >= 16: few variants
def _kda_chunk_intra_kernel(
    q_ptr, k_ptr, g_ptr, akk_ptr, aqk_ptr, cu_ptr, chunk_cu_ptr,
    stride_q_t, stride_k_t, scale, B,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BDK: tl.constexpr,
    BLOCK_B: tl.constexpr, PREC: tl.constexpr,
):
    """Rows of sub-chunk i of chunk p (head h) of Akk and Aqk: [BS, BT] each."""
    p = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    if p >= tl.load(chunk_cu_ptr + B):
        return
    # chunk p -> request b (how many requests' chunk ranges end at or before p), first token t0, n tokens
    ob = tl.arange(0, BLOCK_B)
    ends = tl.load(chunk_cu_ptr + 1 + ob, mask=ob < B, other=2147483647)
    b = tl.reduce((ends <= p).to(tl.int32), 0, _sum_combine)
    t0 = tl.load(cu_ptr + b) + (p - tl.load(chunk_cu_ptr + b)) * BT
    n = tl.minimum(tl.load(cu_ptr + b + 1) - t0, BT)
    if i * BS >= n:
        return

    rows = tl.arange(0, BT)                      # keys: the whole chunk (only earlier sub-chunks are used)
    before = rows < i * BS
    mk = (rows < n)[:, None]
    tr = (t0 + rows).to(tl.int64)
    k_rows = k_ptr + tr[:, None] * stride_k_t + h * D
    g_rows = g_ptr + (tr[:, None] * H + h) * D
    sr = tl.arange(0, BS)                        # this program's rows: sub-chunk i
    si = i * BS + sr
    ms = (si < n)[:, None]
    ts = (t0 + si).to(tl.int64)
    ki_rows = k_ptr + ts[:, None] * stride_k_t + h * D
    qi_rows = q_ptr + ts[:, None] * stride_q_t + h * D
    gi_rows = g_ptr + (ts[:, None] * H + h) * D
    lower_in_blk = (sr[:, None] >= sr[None, :])[:, :, None]

    # pass 1: L2 norms over the full head dim
    k_ss = tl.full([BT], 0.0, tl.float32)
    ki_ss = tl.full([BS], 0.0, tl.float32)
    qi_ss = tl.full([BS], 0.0, tl.float32)
    for d0 in range(0, D, BDK):
        d = d0 + tl.arange(0, BDK)
        kc = tl.load(k_rows + d[None, :], mask=mk & before[:, None], other=0.0).to(tl.float32)
        k_ss += tl.reduce(kc * kc, 1, _sum_combine)
        kc = tl.load(ki_rows + d[None, :], mask=ms, other=0.0).to(tl.float32)
        ki_ss += tl.reduce(kc * kc, 1, _sum_combine)
        qc = tl.load(qi_rows + d[None, :], mask=ms, other=0.0).to(tl.float32)
        qi_ss += tl.reduce(qc * qc, 1, _sum_combine)
    k_rn = 1.0 / tl.sqrt(k_ss + 1e-6)
    ki_rn = 1.0 / tl.sqrt(ki_ss + 1e-6)
    qi_rn = scale / tl.sqrt(qi_ss + 1e-6)

    # pass 2, per slice of the head dim (channels decay independently):
    #   keys of earlier sub-chunks through P = the decay sum before sub-chunk i (a dot; both factors <= 1):
    #       exp(G_t - G_s) = exp(G_t - P) * exp(P - G_s)
    #   keys of sub-chunk i with the exact pairwise exponent, as [row a, key c, d] tensors
    akk = tl.full([BS, BT], 0.0, tl.float32)
    aqk = tl.full([BS, BT], 0.0, tl.float32)
    dkk = tl.full([BS, BS], 0.0, tl.float32)
    dqk = tl.full([BS, BS], 0.0, tl.float32)
    for d0 in range(0, D, BDK):
        d = d0 + tl.arange(0, BDK)
        kn = tl.load(k_rows + d[None, :], mask=mk & before[:, None], other=0.0).to(tl.float32) * k_rn[:, None]
        g = tl.load(g_rows + d[None, :], mask=mk & before[:, None], other=0.0)
        P = tl.reduce(g, 0, _sum_combine)                        # g is zero from row i*BS on
        G = tl.associative_scan(g, 0, _sum_combine)
        R = kn * tl.exp(tl.where(before[:, None], P[None, :] - G, float("-inf")))
        ki = tl.load(ki_rows + d[None, :], mask=ms, other=0.0).to(tl.float32) * ki_rn[:, None]
        qi = tl.load(qi_rows + d[None, :], mask=ms, other=0.0).to(tl.float32) * qi_rn[:, None]
        gi = tl.load(gi_rows + d[None, :], mask=ms, other=0.0)
        Gi = tl.associative_scan(gi, 0, _sum_combine)            # G - P on sub-chunk i (<= 0)
        egi = tl.exp(Gi)
        akk += tl.dot(ki * egi, tl.trans(R), input_precision=PREC)
        aqk += tl.dot(qi * egi, tl.trans(R), input_precision=PREC)
        e = tl.exp(tl.where(lower_in_blk, Gi[:, None, :] - Gi[None, :, :], float("-inf")))
        ke = ki[None, :, :] * e
        dkk += tl.reduce(ki[:, None, :] * ke, 2, _sum_combine)
        dqk += tl.reduce(qi[:, None, :] * ke, 2, _sum_combine)
    dkk = tl.where(sr[:, None] > sr[None, :], dkk, 0.0)

    # columns of earlier sub-chunks and zeros past this one from the dot, the diagonal block from the exact pass
    # (disjoint addresses, so the stores never race)
    cols = tl.arange(0, BT)
    outside = ms & ((cols < i * BS) | (cols >= (i + 1) * BS))[None, :]
    offs = (ts[:, None] * H + h) * BT
    tl.store(akk_ptr + offs + cols[None, :], akk, mask=outside)
    tl.store(aqk_ptr + offs + cols[None, :], aqk, mask=outside)
    tl.store(akk_ptr + offs + si[None, :], dkk, mask=ms)
    tl.store(aqk_ptr + offs + si[None, :], dqk, mask=ms)


@triton.jit(do_not_specialize=["B"])        # B changes every step; BLOCK_B >= 16: few variants
def _kda_chunk_solve_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, akk_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, gn_ptr, cu_ptr, chunk_cu_ptr,
    stride_q_t, stride_k_t, stride_v_t, scale, B,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BDK: tl.constexpr,
    BLOCK_B: tl.constexpr, PREC: tl.constexpr,
):
    tl.static_assert(BT <= 4 * BS, "the block inverse below assumes at most 4 sub-chunks")
    p = tl.program_id(0)
    h = tl.program_id(1)
    if p >= tl.load(chunk_cu_ptr + B):
        return
    ob = tl.arange(0, BLOCK_B)
    ends = tl.load(chunk_cu_ptr + 1 + ob, mask=ob < B, other=2147483647)
    b = tl.reduce((ends <= p).to(tl.int32), 0, _sum_combine)
    t0 = tl.load(cu_ptr + b) + (p - tl.load(chunk_cu_ptr + b)) * BT
    n = tl.minimum(tl.load(cu_ptr + b + 1) - t0, BT)

    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    mr = rows < n
    m2 = mr[:, None]
    tr = (t0 + rows).to(tl.int64)
    a = tl.load(akk_ptr + (tr[:, None] * H + h) * BT + cols[None, :], mask=m2, other=0.0)
    beta = tl.load(beta_ptr + tr * H + h, mask=mr, other=0.0)
    L = a * beta[:, None]                                     # strictly lower triangular
    same = (rows // BS)[:, None] == (cols // BS)[None, :]
    Ld = tl.where(same, L, 0.0)                               # diagonal 16x16 blocks
    N = tl.where(same, 0.0, L)                                # strictly block-lower rest
    eye = tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
    # X = (I + Ld)^-1: forward substitution in all diagonal blocks at once, one in-block row index per step
    X = eye
    for jj in range(1, BS):
        X = tl.where((rows % BS == jj)[:, None], eye - tl.dot(Ld, X, input_precision=PREC), X)
    # (I + L)^-1 = (I + M)^-1 X with M = X N strictly block-lower (M^4 = 0): (I + M)^-1 = (I - M)(I + M^2)
    M = tl.dot(X, N, input_precision=PREC)
    Y = X + tl.dot(tl.dot(M, M, input_precision=PREC), X, input_precision=PREC)
    Tm = (Y - tl.dot(M, Y, input_precision=PREC)) * beta[None, :]      # T = (I + diag(b) Akk)^-1 diag(b)

    # everything the sequential pass needs that does not depend on the state, per slice of the head dim:
    #   W = T (K * exp G), U = T V, Q * exp G, K * exp(Gn - G), exp(Gn)
    k_rows = k_ptr + tr[:, None] * stride_k_t + h * D
    q_rows = q_ptr + tr[:, None] * stride_q_t + h * D
    k_ss = tl.full([BT], 0.0, tl.float32)
    q_ss = tl.full([BT], 0.0, tl.float32)
    for d0 in range(0, D, BDK):
        d = d0 + tl.arange(0, BDK)
        kc = tl.load(k_rows + d[None, :], mask=m2, other=0.0).to(tl.float32)
        qc = tl.load(q_rows + d[None, :], mask=m2, other=0.0).to(tl.float32)
        k_ss += tl.reduce(kc * kc, 1, _sum_combine)
        q_ss += tl.reduce(qc * qc, 1, _sum_combine)
    k_rn = 1.0 / tl.sqrt(k_ss + 1e-6)
    q_rn = scale / tl.sqrt(q_ss + 1e-6)
    for d0 in range(0, D, BDK):
        d = d0 + tl.arange(0, BDK)
        hoff = (tr[:, None] * H + h) * D + d[None, :]
        kn = tl.load(k_rows + d[None, :], mask=m2, other=0.0).to(tl.float32) * k_rn[:, None]
        qn = tl.load(q_rows + d[None, :], mask=m2, other=0.0).to(tl.float32) * q_rn[:, None]
        g = tl.load(g_ptr + hoff, mask=m2, other=0.0)
        G = tl.associative_scan(g, 0, _sum_combine)
        Gn = tl.reduce(g, 0, _sum_combine)
        eg = tl.exp(G)
        tl.store(w_ptr + hoff, tl.dot(Tm, kn * eg, input_precision=PREC), mask=m2)
        tl.store(qg_ptr + hoff, qn * eg, mask=m2)
        tl.store(kd_ptr + hoff, kn * tl.exp(Gn[None, :] - G), mask=m2)
        tl.store(gn_ptr + (p * H + h) * D + d, tl.exp(Gn))
        vv = tl.load(v_ptr + tr[:, None] * stride_v_t + h * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        tl.store(u_ptr + hoff, tl.dot(Tm, vv, input_precision=PREC), mask=m2)


@triton.jit
def _kda_chunk_state_kernel(
    w_ptr, u_ptr, qg_ptr, kd_ptr, gn_ptr, aqk_ptr, state_ptr, o_ptr, cu_ptr, chunk_cu_ptr, slots_ptr,
    stride_s_slot,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_v = tl.program_id(2)
    bos = tl.load(cu_ptr + b)
    eos = tl.load(cu_ptr + b + 1)
    c0 = tl.load(chunk_cu_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    dk = tl.arange(0, D)
    dv = pid_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    s_ptrs = state_ptr + slot * stride_s_slot + h * D * D + dk[:, None] * D + dv[None, :]
    S = tl.load(s_ptrs)
    nchunks = (eos - bos + BT - 1) // BT
    for j in range(0, nchunks):
        tr = (bos + j * BT + rows).to(tl.int64)
        m2 = (rows < eos - bos - j * BT)[:, None]
        hrow = (tr[:, None] * H + h) * D
        w = tl.load(w_ptr + hrow + dk[None, :], mask=m2, other=0.0)
        u = tl.load(u_ptr + hrow + dv[None, :], mask=m2, other=0.0) - tl.dot(w, S, input_precision=PREC)
        qg = tl.load(qg_ptr + hrow + dk[None, :], mask=m2, other=0.0)
        aqk = tl.load(aqk_ptr + (tr[:, None] * H + h) * BT + cols[None, :], mask=m2, other=0.0)
        o = tl.dot(qg, S, input_precision=PREC) + tl.dot(aqk, u, input_precision=PREC)
        tl.store(o_ptr + hrow + dv[None, :], o.to(o_ptr.dtype.element_ty), mask=m2)
        kd = tl.load(kd_ptr + hrow + dk[None, :], mask=m2, other=0.0)
        gn = tl.load(gn_ptr + ((c0 + j) * H + h) * D + dk)
        S = S * gn[:, None] + tl.dot(tl.trans(kd), u, input_precision=PREC)
    tl.store(s_ptrs, S)


def kda_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `kda_recurrent`, for segments of any length: q, k, v [T, H, D] (heads and D contiguous;
    any token stride), g [T, H, D] fp32, beta [T, H] fp32, state [S, H, D, D] fp32 contiguous, updated in place."""
    T, H, D = q.shape
    B = slots.shape[0]
    if out is None:
        out = torch.empty((T, H, D), dtype=v.dtype, device=v.device)
    if B == 0 or T == 0:
        return out, state
    BT, BS = CHUNK, SUB
    BV = min(32, D)
    prec = dot_precision(q)
    BLOCK_B = max(16, triton.next_power_of_2(B))
    scale = D ** -0.5
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    chunk_cu = torch.zeros(B + 1, dtype=torch.int32, device=q.device)
    chunk_cu[1:] = torch.cumsum(torch.div(lens + (BT - 1), BT, rounding_mode="floor"), 0)
    n_chunks_max = T // BT + B
    f32 = dict(dtype=torch.float32, device=q.device)
    akk = torch.empty((T, H, BT), **f32)
    aqk = torch.empty((T, H, BT), **f32)
    w, u, qg, kd = (torch.empty((T, H, D), **f32) for _ in range(4))
    gn = torch.empty((n_chunks_max, H, D), **f32)
    BDK = min(D, 16)
    _kda_chunk_intra_kernel[(n_chunks_max, H, BT // BS)](
        q, k, g, akk, aqk, cu_seqlens, chunk_cu,
        q.stride(0), k.stride(0), scale, B,
        H=H, D=D, BT=BT, BS=BS, BDK=BDK, BLOCK_B=BLOCK_B, PREC=prec, num_warps=4,
    )
    _kda_chunk_solve_kernel[(n_chunks_max, H)](
        q, k, v, g, beta, akk, w, u, qg, kd, gn, cu_seqlens, chunk_cu,
        q.stride(0), k.stride(0), v.stride(0), scale, B,
        H=H, D=D, BT=BT, BS=BS, BDK=BDK, BLOCK_B=BLOCK_B, PREC=prec, num_warps=4,
    )
    _kda_chunk_state_kernel[(B, H, triton.cdiv(D, BV))](
        w, u, qg, kd, gn, aqk, state, out, cu_seqlens, chunk_cu, slots,
        state.stride(0),
        H=H, D=D, BT=BT, BV=BV, PREC=prec, num_warps=4, num_stages=STATE_STAGES,
    )
    return out, state
