"""Short causal depthwise conv + SiLU over a flat varlen token batch, with the per-request conv state pool.

For request b (tokens cu[b]:cu[b+1], state slot slots[b]) and channel c, with the K-1 previous inputs held in
`conv_state[slot, c, :]` (column K-2 the most recent):
    xx  = conv_state[slot, c, :] ++ x[cu[b]:cu[b+1], c]
    out[t, c] = silu(sum_j weight[c, j] * xx[t - (K-1) + j])         (weight[c, K-1] multiplies the current input)
and afterwards conv_state[slot, c, :] = the last K-1 entries of xx (also when the segment is shorter than K-1).

Two launches: the conv reads the old state, then the update rewrites it in place (no program may read a state
column that another program is rewriting, so they cannot share one launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Tile of the conv: BT tokens x up to BC channels, 4 warps (32 values a thread). Fixed, whatever T: a serving
# step meets one variant per (model width, dtype, layout), the one the warm-up's first step compiles.
CONV_BT = 64
CONV_BC = 128
CONV_WARPS = 4
STATE_BC = 256          # channels a program of the per-request kernel


# T, B, the search length and the plane offset change with every step: left unspecialized (Triton would compile a
# variant per ==1 / %16 class of each). The row strides stay specialized: their divisibility by 16 is what lets
# the loads and stores move 16 bytes a thread.
@triton.jit(do_not_specialize=["T", "B", "n_search", "plane_rows"])
def _short_conv_fwd_kernel(
    x_ptr, w_ptr, out_ptr, cu_ptr,
    T, C, W, B, n_search, plane_rows, stride_x_t, stride_o_t,
    KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    """The tokens at least K-1 into their segment, whose K taps all read x: no state, no per-tap mask. The first
    K-1 tokens of each segment are `_short_conv_state_kernel`'s."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    c0 = pid_c * BC
    c = c0 + tl.arange(0, BC)
    mc = c < C
    # owning request of each token: the last b with cu[b] <= t, by bisection over [0, B) (n_search = ceil(log2 B)
    # halvings), so the cost grows with log B and no constexpr follows the batch size
    lo = tl.zeros([BT], dtype=tl.int32)
    hi = tl.zeros([BT], dtype=tl.int32) + B
    for _ in range(n_search):
        mid = (lo + hi) >> 1
        right = tl.load(cu_ptr + mid) <= t
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    keep = (t < T) & (t - tl.load(cu_ptr + lo) >= KW - 1)
    m = keep[:, None] & mc[None, :]
    # 64-bit tile bases, 32-bit offsets within the tile (one wide add a pointer instead of 64-bit products)
    r = tl.arange(0, BT)
    t0 = (pid_t * BT).to(tl.int64)
    xt = x_ptr + t0 * stride_x_t
    # tap j reads the input K-1-j tokens back; the K taps of a tile re-read its rows, which the L1 serves (HBM sees
    # each row about once). Masked rows load nothing and store nothing, so no fill value is needed.
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KW):
        w = tl.load(w_ptr + c * KW + j, mask=mc, other=0.0).to(tl.float32)
        xv = tl.load(xt + ((r - (KW - 1 - j)) * stride_x_t)[:, None] + c[None, :], mask=m)
        acc += xv.to(tl.float32) * w[None, :]
    y = acc / (1.0 + tl.exp(-tl.maximum(acc, -88.0)))          # silu; the clamp keeps exp finite
    # channel c goes to plane c // W, column c % W; a tile lies in one plane (the host picks BC dividing W), and
    # planes lie plane_rows output rows apart
    plane = c0 // W
    ot = out_ptr + (plane.to(tl.int64) * plane_rows + t0) * stride_o_t + (c0 - plane * W)
    tl.store(ot + (r * stride_o_t)[:, None] + tl.arange(0, BC)[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


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
    """Launches the conv of the tokens K-1 or more into their segment, then the per-request kernel (the first K-1
    tokens' outputs, then the state update in place). x [T, C] (unit stride along C), weight [C, K], conv_state
    [S, C, K-1] (unit stride along K-1), cu_seqlens int32 [B+1], slots int32 [B]. parts = 1: out [T, C];
    parts = P > 1: out [P, T, C/P] (channel c in plane c // (C/P)) with unit stride along its last dim and a plane
    stride that is a multiple of its row stride: contiguous planes, e.g. q, k, v ready for the KDA kernels."""
    T, C = x.shape
    KW = weight.shape[1]
    B = slots.shape[0]
    W = C // parts
    if out is None:
        out = torch.empty((T, C) if parts == 1 else (parts, T, W), dtype=x.dtype, device=x.device)
    stride_o_t = out.stride(-2)
    plane_rows = 0 if parts == 1 else out.stride(0) // stride_o_t
    if T > 0:
        BC = _channel_tile(C, parts, CONV_BC)
        _short_conv_fwd_kernel[(triton.cdiv(T, CONV_BT), triton.cdiv(C, BC))](
            x, weight, out, cu_seqlens,
            T, C, W, B, (B - 1).bit_length(), plane_rows, x.stride(0), stride_o_t,
            KW=KW, BT=CONV_BT, BC=BC, num_warps=CONV_WARPS,
        )
    if B > 0:
        BC = _channel_tile(C, parts, STATE_BC)
        _short_conv_state_kernel[(B, triton.cdiv(C, BC))](
            x, weight, conv_state, out, cu_seqlens, slots,
            C, W, plane_rows, x.stride(0), stride_o_t, conv_state.stride(0), conv_state.stride(1),
            KW=KW, BW=triton.next_power_of_2(max(KW - 1, 1)), BC=BC, num_warps=4,
        )
    return out, conv_state
