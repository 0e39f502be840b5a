"""KDA chunked prefill: the recurrence of `recurrent.py` for long varlen segments, in chunks of BT = 64 tokens.

Math (per request, head and chunk; S0 the state entering the chunk, G = within-chunk cumsum of g, Gn = G[last]):
    the recurrence is S_t = (I - b_t k_t k_t^T) diag(exp g_t) S_{t-1} + b_t k_t v_t^T. Unrolled over a chunk,
    S_t = diag(exp G_t) S0 + sum_{s<=t} diag(exp(G_t - G_s)) k_s u_s^T with pseudo-values u_s satisfying
        (I + diag(b) Akk) U = diag(b) (V - (K * exp G) S0),   Akk[t, s] = sum_d k_td k_sd exp(G_td - G_sd), s < t
    so with T = (I + diag(b) Akk)^-1 diag(b) (the UT / WY form):
        U      = T (V - (K * exp G) S0)
        O      = (Q * exp G) S0 + Aqk U,            Aqk[t, s] = sum_d q_td k_sd exp(G_td - G_sd), s <= t
        S_next = diag(exp Gn) S0 + (K * exp(Gn - G))^T U
Every exponent above is <= 0 (g <= 0), so nothing overflows however strong the decay. Akk / Aqk are built in
16-token sub-chunks: between sub-chunks through the reference point P = G at the end of the earlier sub-chunks,
exp(G_t - G_s) = exp(G_t - P) exp(P - G_s) with both factors <= 1 (a tensor-core dot); within a sub-chunk the
exact pairwise exponent, one key column at a time.

Three launches, none of which reads a host value (chunk bookkeeping stays on the device):
    1. intra  (chunk, head, sub-chunk): Akk and Aqk rows into [T, H, BT] scratch
    2. solve  (chunk, head): T = (I + diag(b) Akk)^-1 diag(b) by forward substitution, in place of Akk
    3. state  (request, head, v-tile): walks the request's chunks in order with its [D, BV] state slice in
       registers, writes O, and stores the final state back to the pool slot.
Chunks never cross requests: a request of n tokens owns ceil(n / BT) chunks, numbered through `chunk_cu`, and
launches 1 and 2 run over an upper bound T // BT + B of chunk programs (the spare ones return at once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.kda._common import dot_precision, request_of_scalar

CHUNK = 64          # tokens per chunk
SUB = 16            # tokens per sub-chunk (the exact-exponent diagonal blocks)


@triton.jit
def _chunk_coords(cu_ptr, chunk_cu_ptr, p, B, BT: tl.constexpr, BLOCK_B: tl.constexpr):
    """(first token, valid tokens) of global chunk p."""
    b = request_of_scalar(chunk_cu_ptr, p, B, BLOCK_B)
    j = p - tl.load(chunk_cu_ptr + b)
    bos = tl.load(cu_ptr + b)
    eos = tl.load(cu_ptr + b + 1)
    t0 = bos + j * BT
    n = tl.minimum(eos - t0, BT)
    return t0, n


@triton.jit
def _kda_chunk_intra_kernel(
    q_ptr, k_ptr, g_ptr, akk_ptr, aqk_ptr, cu_ptr, chunk_cu_ptr,
    stride_q_t, stride_k_t, scale, B,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BLOCK_B: tl.constexpr,
    PREC: tl.constexpr,
):
    p = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    if p >= tl.load(chunk_cu_ptr + B):
        return
    t0, n = _chunk_coords(cu_ptr, chunk_cu_ptr, p, B, BT, BLOCK_B)

    rows = tl.arange(0, BT)
    d = tl.arange(0, D)
    mr = rows < n
    tr = (t0 + rows).to(tl.int64)
    # the whole chunk's keys and cumulative log-decay (rows past the segment are zero keys, zero decay)
    k = tl.load(k_ptr + tr[:, None] * stride_k_t + h * D + d[None, :], mask=mr[:, None], other=0.0).to(tl.float32)
    kn = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    g = tl.load(g_ptr + (tr[:, None] * H + h) * D + d[None, :], mask=mr[:, None], other=0.0)
    G = tl.cumsum(g, axis=0)

    # this program's sub-chunk rows
    sr = tl.arange(0, BS)
    srow = i * BS + sr
    ms = srow < n
    ts = (t0 + srow).to(tl.int64)
    ki = tl.load(k_ptr + ts[:, None] * stride_k_t + h * D + d[None, :], mask=ms[:, None], other=0.0).to(tl.float32)
    kni = ki / tl.sqrt(tl.sum(ki * ki, axis=1) + 1e-6)[:, None]
    qi = tl.load(q_ptr + ts[:, None] * stride_q_t + h * D + d[None, :], mask=ms[:, None], other=0.0).to(tl.float32)
    qni = qi * (scale / tl.sqrt(tl.sum(qi * qi, axis=1) + 1e-6))[:, None]
    gi = tl.load(g_ptr + (ts[:, None] * H + h) * D + d[None, :], mask=ms[:, None], other=0.0)
    Gl = tl.cumsum(gi, axis=0)                               # G relative to the reference point P (<= 0)

    # earlier sub-chunks: exp(G_t - G_s) = exp(G_t - P) * exp(P - G_s), P = sum of g before this sub-chunk
    before = rows < i * BS
    P = tl.sum(tl.where(before[:, None], g, 0.0), axis=0)
    R = kn * tl.exp(tl.where(before[:, None], P[None, :] - G, float("-inf")))
    egl = tl.exp(Gl)
    akk = tl.dot(kni * egl, tl.trans(R), input_precision=PREC)     # [BS, BT], columns < i*BS
    aqk = tl.dot(qni * egl, tl.trans(R), input_precision=PREC)

    # same sub-chunk: the exact pairwise exponent, one key column at a time
    cols = tl.arange(0, BT)
    for jj in range(0, BS):
        sel = sr == jj
        kj = tl.sum(tl.where(sel[:, None], kni, 0.0), axis=0)
        gj = tl.sum(tl.where(sel[:, None], Gl, 0.0), axis=0)
        ke = kj[None, :] * tl.exp(tl.where(sr[:, None] >= jj, Gl - gj[None, :], float("-inf")))
        ckk = tl.where(sr > jj, tl.sum(kni * ke, axis=1), 0.0)
        cqk = tl.sum(qni * ke, axis=1)
        hit = cols[None, :] == i * BS + jj
        akk = tl.where(hit, ckk[:, None], akk)
        aqk = tl.where(hit, cqk[:, None], aqk)

    offs = (ts[:, None] * H + h) * BT + cols[None, :]
    tl.store(akk_ptr + offs, akk, mask=ms[:, None])
    tl.store(aqk_ptr + offs, aqk, mask=ms[:, None])


@triton.jit
def _kda_chunk_solve_kernel(
    akk_ptr, beta_ptr, cu_ptr, chunk_cu_ptr, B,
    H: tl.constexpr, BT: tl.constexpr, BLOCK_B: tl.constexpr,
):
    p = tl.program_id(0)
    h = tl.program_id(1)
    if p >= tl.load(chunk_cu_ptr + B):
        return
    t0, n = _chunk_coords(cu_ptr, chunk_cu_ptr, p, B, BT, BLOCK_B)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    mr = rows < n
    tr = (t0 + rows).to(tl.int64)
    offs = (tr[:, None] * H + h) * BT + cols[None, :]
    a = tl.load(akk_ptr + offs, mask=mr[:, None], other=0.0)
    beta = tl.load(beta_ptr + tr * H + h, mask=mr, other=0.0)
    L = a * beta[:, None]                                    # strictly lower triangular
    # X = (I + L)^-1 row by row: x_t = e_t - sum_{s<t} L[t, s] x_s
    X = tl.zeros([BT, BT], dtype=tl.float32)
    for t in range(0, n):
        sel = rows == t
        lt = tl.sum(tl.where(sel[:, None], L, 0.0), axis=0)
        xt = tl.where(cols == t, 1.0, 0.0) - tl.sum(lt[:, None] * X, axis=0)
        X = tl.where(sel[:, None], xt[None, :], X)
    tl.store(akk_ptr + offs, X * beta[None, :], mask=mr[:, None])


@triton.jit
def _kda_chunk_state_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, t_ptr, aqk_ptr, state_ptr, o_ptr, cu_ptr, slots_ptr,
    stride_q_t, stride_k_t, stride_v_t, stride_s_slot, scale,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_v = tl.program_id(2)
    bos = tl.load(cu_ptr + b)
    eos = tl.load(cu_ptr + b + 1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    dk = tl.arange(0, D)
    dv = pid_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    s_ptrs = state_ptr + slot * stride_s_slot + h * D * D + dk[:, None] * D + dv[None, :]
    S = tl.load(s_ptrs)
    nchunks = (eos - bos + BT - 1) // BT
    for j in range(0, nchunks):
        t0 = bos + j * BT
        mr = rows < eos - t0
        tr = (t0 + rows).to(tl.int64)
        m2 = mr[:, None]
        q = tl.load(q_ptr + tr[:, None] * stride_q_t + h * D + dk[None, :], mask=m2, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tr[:, None] * stride_k_t + h * D + dk[None, :], mask=m2, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tr[:, None] * stride_v_t + h * D + dv[None, :], mask=m2, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + (tr[:, None] * H + h) * D + dk[None, :], mask=m2, other=0.0)
        aoffs = (tr[:, None] * H + h) * BT + cols[None, :]
        tm = tl.load(t_ptr + aoffs, mask=m2, other=0.0)
        aqk = tl.load(aqk_ptr + aoffs, mask=m2, other=0.0)
        qn = q * (scale / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6))[:, None]
        kn = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        G = tl.cumsum(g, axis=0)
        Gn = tl.sum(g, axis=0)
        eg = tl.exp(G)
        u = tl.dot(tm, v - tl.dot(kn * eg, S, input_precision=PREC), input_precision=PREC)
        o = tl.dot(qn * eg, S, input_precision=PREC) + tl.dot(aqk, u, input_precision=PREC)
        tl.store(o_ptr + (tr[:, None] * H + h) * D + dv[None, :], o.to(o_ptr.dtype.element_ty), mask=m2)
        kd = kn * tl.exp(Gn[None, :] - G)
        S = S * tl.exp(Gn)[:, None] + tl.dot(tl.trans(kd), u, input_precision=PREC)
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
    BLOCK_B = triton.next_power_of_2(B)
    scale = D ** -0.5
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    chunk_cu = torch.zeros(B + 1, dtype=torch.int32, device=q.device)
    chunk_cu[1:] = torch.cumsum(torch.div(lens + (BT - 1), BT, rounding_mode="floor"), 0)
    n_chunks_max = T // BT + B
    akk = torch.empty((T, H, BT), dtype=torch.float32, device=q.device)
    aqk = torch.empty((T, H, BT), dtype=torch.float32, device=q.device)
    _kda_chunk_intra_kernel[(n_chunks_max, H, BT // BS)](
        q, k, g, akk, aqk, cu_seqlens, chunk_cu,
        q.stride(0), k.stride(0), scale, B,
        H=H, D=D, BT=BT, BS=BS, BLOCK_B=BLOCK_B, PREC=prec, num_warps=4,
    )
    _kda_chunk_solve_kernel[(n_chunks_max, H)](
        akk, beta, cu_seqlens, chunk_cu, B,
        H=H, BT=BT, BLOCK_B=BLOCK_B, num_warps=4,
    )
    _kda_chunk_state_kernel[(B, H, triton.cdiv(D, BV))](
        q, k, v, g, akk, aqk, state, out, cu_seqlens, slots,
        q.stride(0), k.stride(0), v.stride(0), state.stride(0), scale,
        H=H, D=D, BT=BT, BV=BV, PREC=prec, num_warps=4,
    )
    return out, state
