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

from kestrel.kernels.kda._common import _sum_combine


# T and B change with every prefill step: left unspecialized (Triton would compile a variant per ==1 / %16 class of
# each), and BLOCK_B is at least 16, so a serving step meets only the few variants the warm-up compiled
@triton.jit(do_not_specialize=["T", "B"])
def _short_conv_fwd_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, cu_ptr, slots_ptr,
    T, C, B,
    stride_x_t, stride_o_t, stride_s_slot, stride_s_c,
    KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BLOCK_B: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    c = pid_c * BC + tl.arange(0, BC)
    mt = t < T
    mc = c < C
    # owning request of each token: how many requests end at or before it
    ob = tl.arange(0, BLOCK_B)
    ends = tl.load(cu_ptr + 1 + ob, mask=ob < B, other=2147483647)
    b = tl.reduce((ends[None, :] <= t[:, None]).to(tl.int32), 1, _sum_combine)
    b = tl.minimum(b, B - 1)
    start = tl.load(cu_ptr + b, mask=mt, other=0)
    slot = tl.load(slots_ptr + b, mask=mt, other=0).to(tl.int64)
    t64 = t.to(tl.int64)
    acc = tl.full([BT, BC], 0.0, tl.float32)
    for j in tl.static_range(KW):
        p = t - (KW - 1) + j                      # source position of tap j
        in_seg = p >= start
        m_x = (mt & in_seg)[:, None] & mc[None, :]
        xv = tl.load(x_ptr + (t64 - (KW - 1) + j)[:, None] * stride_x_t + c[None, :], mask=m_x, other=0.0)
        col = (KW - 1) + (p - start)              # state column when p precedes the segment: in [0, KW-2]
        m_s = (mt & (~in_seg))[:, None] & mc[None, :]
        sv = tl.load(state_ptr + slot[:, None] * stride_s_slot + c[None, :] * stride_s_c + col[:, None],
                     mask=m_s, other=0.0)
        w = tl.load(w_ptr + c * KW + j, mask=mc, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    y = acc / (1.0 + tl.exp(-tl.maximum(acc, -88.0)))          # silu; the clamp keeps exp finite
    tl.store(out_ptr + t64[:, None] * stride_o_t + c[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@triton.jit
def _short_conv_state_kernel(
    x_ptr, state_ptr, cu_ptr, slots_ptr,
    C, stride_x_t, stride_s_slot, stride_s_c,
    KW: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):
    b = tl.program_id(0)
    pid_c = tl.program_id(1)
    start = tl.load(cu_ptr + b)
    end = tl.load(cu_ptr + b + 1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    c = pid_c * BC + tl.arange(0, BC)
    i = tl.arange(0, BW)                          # new state column
    mc = c < C
    mi = i < KW - 1
    p = end - (KW - 1) + i                        # position whose input lands in column i
    in_seg = p >= start
    m_x = mc[:, None] & (mi & in_seg)[None, :]
    xv = tl.load(x_ptr + p.to(tl.int64)[None, :] * stride_x_t + c[:, None], mask=m_x, other=0.0)
    col = (KW - 1) + (p - start)                  # old column kept (i + segment length) when p precedes it
    base = state_ptr + slot * stride_s_slot + c[:, None] * stride_s_c
    m_s = mc[:, None] & (mi & (~in_seg))[None, :]
    sv = tl.load(base + col[None, :], mask=m_s, other=0.0)
    new = tl.where(in_seg[None, :], xv.to(state_ptr.dtype.element_ty), sv)
    # every thread of the program has read the old columns before any thread rewrites them
    tl.debug_barrier()
    tl.store(base + i[None, :], new, mask=mc[:, None] & mi[None, :])


def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
               slots: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the conv then the in-place state update. x [T, C] (unit stride along C), weight [C, K],
    conv_state [S, C, K-1] (unit stride along K-1), cu_seqlens int32 [B+1], slots int32 [B]."""
    T, C = x.shape
    KW = weight.shape[1]
    B = slots.shape[0]
    if out is None:
        out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    if T > 0:
        BT = min(32, triton.next_power_of_2(T))
        BC = min(128, triton.next_power_of_2(C))
        grid = (triton.cdiv(T, BT), triton.cdiv(C, BC))
        _short_conv_fwd_kernel[grid](
            x, weight, conv_state, out, cu_seqlens, slots,
            T, C, B,
            x.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1),
            KW=KW, BT=BT, BC=BC, BLOCK_B=max(16, triton.next_power_of_2(B)), num_warps=4,
        )
    if B > 0:
        BC = min(256, triton.next_power_of_2(C))
        _short_conv_state_kernel[(B, triton.cdiv(C, BC))](
            x, conv_state, cu_seqlens, slots,
            C, x.stride(0), conv_state.stride(0), conv_state.stride(1),
            KW=KW, BW=triton.next_power_of_2(max(KW - 1, 1)), BC=BC, num_warps=4,
        )
    return out, conv_state
