"""Short causal depthwise conv + SiLU over a flat varlen token batch, with the per-request conv state pool.

For request b (tokens cu[b]:cu[b+1], state slot slots[b]) and channel c, with the K-1 previous inputs held in
`conv_state[slot, c, :]` (column K-2 the most recent):
    xx  = conv_state[slot, c, :] ++ x[cu[b]:cu[b+1], c]
    out[t, c] = silu(sum_j weight[c, j] * xx[t - (K-1) + j])         (weight[c, K-1] multiplies the current input)
and afterwards conv_state[slot, c, :] = the last K-1 entries of xx (also when the segment is shorter than K-1).

Two launches. The conv kernel computes every token as if its K taps all read x, which is right for the tokens K-1 or
more into their segment and needs no segment layout. The per-request kernel, launched after it on the same stream,
rewrites the first min(n, K-1) outputs of each segment from the old state and x, then the state in place (one
program owns a slot's channel tile, reading it whole before rewriting it; the conv kernel never reads the state).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# The conv kernel: a program runs down CONV_ROWS tokens of one channel tile, 4 rows a loop step, keeping the
# previous K-1 input rows in registers: each input is loaded and converted once, then used by K outputs. A step loads
# its 4 rows before it stores anything (the compiler may not move a load above a store that could alias it), so each
# thread has 4 x 16 bytes in flight. Fixed whatever T: a serving step meets one variant per (model width, dtype,
# layout), the one the warm-up's first step compiles.
CONV_ROWS = 32
CONV_BC = 1024          # channels a program: 8 a thread at 4 warps
MAX_K = 4               # the register window: K <= 4 (Kimi Linear and K3: 4)
STATE_BC = 256          # channels a program of the per-request kernel


@triton.jit
def _tap_weight(w_ptr, c, mc, KW: tl.constexpr, tap: tl.constexpr):
    """weight[c, tap - (4 - K)] in fp32, tap 3 multiplying the current input (taps before the K real ones: unused)."""
    if tap >= 4 - KW:
        return tl.load(w_ptr + c * KW + (tap - (4 - KW)), mask=mc, other=0.0).to(tl.float32)
    else:
        return tl.zeros(c.shape, dtype=tl.float32)


@triton.jit
def _row(ptr, c, C, ok):
    """One input row in fp32 (`ok`, that the row exists, comes per channel: the interpreter will not mask by a
    scalar)."""
    return tl.load(ptr, mask=(c < C) & ok, other=0.0).to(tl.float32)


@triton.jit
def _silu_of(w0, w1, w2, w3, a, b, c, d, KW: tl.constexpr):
    """silu of the taps over inputs a, b, c, d (d the current one; for K < 4 the first 4-K are not read); the clamp
    keeps exp(-acc) finite. The taps are summed oldest first from zero and the SiLU is x / (1 + exp(-x)), as the
    per-request kernel and the reference do: in fp32 (the interpreter) all three agree bit for bit, which the
    quantized-page tests rely on (an e4m3 code of a deeper layer flips on an ulp of the conv)."""
    acc = tl.zeros_like(d)
    if KW >= 4:
        acc += w0 * a
    if KW >= 3:
        acc += w1 * b
    if KW >= 2:
        acc += w2 * c
    acc += w3 * d
    return acc / (1.0 + tl.exp(-tl.maximum(acc, -88.0)))


# T and the plane offset change with every step: left unspecialized (Triton would compile a variant per ==1 / %16
# class of each). The row strides and C stay specialized: their divisibility by 16 is what lets the loads and
# stores move 16 bytes a thread.
@triton.jit(do_not_specialize=["T", "plane_rows"])
def _short_conv_fwd_kernel(
    x_ptr, w_ptr, out_ptr,
    T, C, W, plane_rows, stride_x_t, stride_o_t,
    KW: tl.constexpr, ROWS: tl.constexpr, BC: tl.constexpr,
):
    """Every token's output as if its K taps all read x (rows before token 0 read as 0). That is the output of the
    tokens K-1 or more into their segment; `_short_conv_state_kernel`, launched after, rewrites the first K-1
    tokens of each segment from the conv state, so this kernel needs no segment layout."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    c0 = pid_c * BC
    c = c0 + tl.arange(0, BC)
    mc = c < C
    w0 = _tap_weight(w_ptr, c, mc, KW, 0)      # the input 3 tokens back
    w1 = _tap_weight(w_ptr, c, mc, KW, 1)
    w2 = _tap_weight(w_ptr, c, mc, KW, 2)
    w3 = _tap_weight(w_ptr, c, mc, KW, 3)      # the current input
    t0 = pid_t * ROWS
    tc = tl.zeros([BC], dtype=tl.int32) + t0   # t0 in every lane
    sx = stride_x_t
    xr = x_ptr + t0.to(tl.int64) * sx + c
    x3 = _row(xr - 3 * sx, c, C, tc >= 3)      # x3, x2, x1: the inputs 3, 2, 1 rows before the step's first
    x2 = _row(xr - 2 * sx, c, C, tc >= 2)
    x1 = _row(xr - sx, c, C, tc >= 1)
    # channel c goes to plane c // W, column c % W; a tile lies in one plane (the host picks BC dividing W), and
    # planes lie plane_rows output rows apart
    plane = c0 // W
    orow = out_ptr + (plane.to(tl.int64) * plane_rows + t0) * stride_o_t + (c0 - plane * W) + tl.arange(0, BC)
    so = stride_o_t
    for g in range(0, ROWS, 4):
        a = _row(xr + g * sx, c, C, tc + g < T)
        b = _row(xr + (g + 1) * sx, c, C, tc + (g + 1) < T)
        d = _row(xr + (g + 2) * sx, c, C, tc + (g + 2) < T)
        e = _row(xr + (g + 3) * sx, c, C, tc + (g + 3) < T)
        dt = out_ptr.dtype.element_ty
        tl.store(orow + g * so, _silu_of(w0, w1, w2, w3, x3, x2, x1, a, KW).to(dt), mask=mc & (tc + g < T))
        tl.store(orow + (g + 1) * so, _silu_of(w0, w1, w2, w3, x2, x1, a, b, KW).to(dt), mask=mc & (tc + (g + 1) < T))
        tl.store(orow + (g + 2) * so, _silu_of(w0, w1, w2, w3, x1, a, b, d, KW).to(dt), mask=mc & (tc + (g + 2) < T))
        tl.store(orow + (g + 3) * so, _silu_of(w0, w1, w2, w3, a, b, d, e, KW).to(dt), mask=mc & (tc + (g + 3) < T))
        x3 = b
        x2 = d
        x1 = e


@triton.jit(do_not_specialize=["plane_rows"])
def _short_conv_state_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, cu_ptr, slots_ptr,
    C, W, plane_rows, stride_x_t, stride_o_t, stride_s_slot, stride_s_c,
    KW: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):
    """One request's channel tile: the outputs of its first min(n, K-1) tokens, whose taps reach into the old state,
    then the new state. Over the window old state (K-1 columns) ++ the segment's n inputs, output i is the dot of
    window positions i..i+K-1 and the new state is the last K-1 positions."""
    b = tl.program_id(0)
    pid_c = tl.program_id(1)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    slot = tl.load(slots_ptr + b).to(tl.int64)
    c0 = pid_c * BC
    c = c0 + tl.arange(0, BC)
    mc = c < C
    nc = tl.zeros([BC], dtype=tl.int32) + n          # n per channel (the interpreter will not mask by a scalar)
    old = state_ptr + slot * stride_s_slot + c * stride_s_c
    xs = x_ptr + start.to(tl.int64) * stride_x_t + c
    plane = c0 // W
    o = out_ptr + plane.to(tl.int64) * plane_rows * stride_o_t + start.to(tl.int64) * stride_o_t \
        + (c0 - plane * W) + tl.arange(0, BC)
    for i in tl.static_range(KW - 1):
        live = mc & (nc > i)
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(KW):
            w = tl.load(w_ptr + c * KW + j, mask=mc, other=0.0).to(tl.float32)
            if i + j < KW - 1:
                v = tl.load(old + (i + j), mask=live, other=0.0)
            else:
                v = tl.load(xs + (i + j - (KW - 1)) * stride_x_t, mask=live, other=0.0)
            acc += v.to(tl.float32) * w
        y = acc / (1.0 + tl.exp(-tl.maximum(acc, -88.0)))
        tl.store(o + i * stride_o_t, y.to(out_ptr.dtype.element_ty), mask=live)
    # new column k holds window position n + k: input n + k - (K-1) when that is >= 0, else old column n + k
    k = tl.arange(0, BW)
    mk = k < KW - 1
    p = n + k - (KW - 1)
    xv = tl.load(xs[:, None] + p.to(tl.int64)[None, :] * stride_x_t, mask=mc[:, None] & (mk & (p >= 0))[None, :],
                 other=0.0)
    sv = tl.load(old[:, None] + (n + k)[None, :], mask=mc[:, None] & (mk & (p < 0))[None, :], other=0.0)
    new = tl.where((p >= 0)[None, :], xv.to(state_ptr.dtype.element_ty), sv)
    # every thread of the program has read the old columns before any thread rewrites them
    tl.debug_barrier()
    tl.store(old[:, None] + k[None, :], new, mask=mc[:, None] & mk[None, :])


def _channel_tile(C: int, parts: int, cap: int) -> int:
    """A channel tile of at most `cap`; for parts > 1 a power of two dividing the plane width C/parts (a tile must
    not straddle two planes)."""
    if parts == 1:
        return min(cap, triton.next_power_of_2(C))
    W = C // parts
    return min(cap, W & -W)


def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
               slots: torch.Tensor, out: torch.Tensor | None = None,
               parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the conv kernel over every token, then the per-request kernel (each segment's first K-1 outputs
    rewritten, then the state update in place). x [T, C] (unit stride along C), weight [C, K], conv_state
    [S, C, K-1] (unit stride along K-1), cu_seqlens int32 [B+1], slots int32 [B]. parts = 1: out [T, C];
    parts = P > 1: out [P, T, C/P] (channel c in plane c // (C/P)) with unit stride along its last dim and a plane
    stride that is a multiple of its row stride: contiguous planes, e.g. q, k, v ready for the KDA kernels."""
    T, C = x.shape
    KW = weight.shape[1]
    B = slots.shape[0]
    if not 2 <= KW <= MAX_K:
        raise ValueError(f"short_conv: conv width K={KW} outside 2..{MAX_K}, the kernel's register window")
    W = C // parts
    if out is None:
        out = torch.empty((T, C) if parts == 1 else (parts, T, W), dtype=x.dtype, device=x.device)
    stride_o_t = out.stride(-2)
    plane_rows = 0 if parts == 1 else out.stride(0) // stride_o_t
    if T > 0:
        BC = _channel_tile(C, parts, CONV_BC)
        _short_conv_fwd_kernel[(triton.cdiv(T, CONV_ROWS), triton.cdiv(C, BC))](
            x, weight, out,
            T, C, W, plane_rows, x.stride(0), stride_o_t,
            KW=KW, ROWS=CONV_ROWS, BC=BC, num_warps=max(1, min(4, BC // 256)),
        )
    if B > 0:
        BC = _channel_tile(C, parts, STATE_BC)
        _short_conv_state_kernel[(B, triton.cdiv(C, BC))](
            x, weight, conv_state, out, cu_seqlens, slots,
            C, W, plane_rows, x.stride(0), stride_o_t, conv_state.stride(0), conv_state.stride(1),
            KW=KW, BW=triton.next_power_of_2(max(KW - 1, 1)), BC=BC, num_warps=4,
        )
    return out, conv_state
