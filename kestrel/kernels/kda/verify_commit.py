"""KDA speculative verify commit (replay): advance each verify block's conv and recurrent state over its accepted
tokens only, from the state the block was verified against (the verify left the slot untouched).

Request b (block rows cu[b]:cu[b+1], state slot slots[b], n = accepted[b] <= block length), head h:
    S <- S * exp(g_t)[:, None] ;  S <- S + beta_t * k_t (v_t - S^T k_t)^T      for t < n   (k L2-normalized, fp32)
    conv_state[slot, c, :] <- the last K-1 entries of conv_state[slot, c, :] ++ x[bos:bos + n, c]
One program per (request, head, v-tile) keeps its [D, BV] slice of S in registers, as the recurrent kernel does,
and rewrites the conv state of the channels it owns: the v-tile's slice of head h in each of q, k and v, so the
programs partition the 3*H*D channels and no program reads a column another rewrites (one launch for both).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.kda._common import _sum_combine


@triton.jit
def _kda_verify_commit_kernel(
    x_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, conv_ptr, state_ptr, cu_ptr, slots_ptr, n_ptr,
    stride_x_t, stride_k_t, stride_v_t, stride_c_slot, stride_c_c, stride_s_slot,
    H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, K1: tl.constexpr, K1P: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_v = tl.program_id(2)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    n = tl.load(n_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    dk = tl.arange(0, D)
    dv = pid_v * BV + tl.arange(0, BV)
    s_ptrs = state_ptr + slot * stride_s_slot + h * D * D + dk[:, None] * D + dv[None, :]
    S = tl.load(s_ptrs)
    for i in range(0, n):
        t64 = bos + i
        k = tl.load(k_ptr + t64 * stride_k_t + h * D + dk).to(tl.float32)
        v = tl.load(v_ptr + t64 * stride_v_t + h * D + dv).to(tl.float32)
        g = tl.load(g_ptr + (t64 * H + h) * D + dk)
        beta = tl.load(beta_ptr + t64 * H + h)
        k = k / tl.sqrt(tl.reduce(k * k, 0, _sum_combine) + 1e-6)
        S = S * tl.exp(g)[:, None]
        u = beta * (v - tl.reduce(S * k[:, None], 0, _sum_combine))
        S = S + k[:, None] * u[None, :]
    tl.store(s_ptrs, S)
    # conv state: column j of the new state is entry n + j of [old K-1 columns ++ the n accepted inputs]
    j = tl.arange(0, K1P)
    src = n + j
    live = j < K1
    from_old = live & (src < K1)
    from_x = live & (src >= K1)
    for sec in tl.static_range(3):
        c = sec * H * D + h * D + dv
        c_ptrs = conv_ptr + slot * stride_c_slot + c[:, None] * stride_c_c
        old = tl.load(c_ptrs + src[None, :], mask=from_old[None, :], other=0.0)
        row = bos + (src - K1).to(tl.int64)
        new = tl.load(x_ptr + row[None, :] * stride_x_t + c[:, None], mask=from_x[None, :], other=0.0)
        new = tl.where(from_old[None, :], old, new.to(old.dtype))
        tl.store(c_ptrs + j[None, :], new, mask=live[None, :])


def kda_verify_commit(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      conv_state: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                      accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 3*H*D] (unit channel stride), k, v [T, H, D] (heads and D contiguous, any token stride),
    g [T, H, D] fp32, beta [T, H] fp32, conv_state [S, 3*H*D, K-1] (unit column stride), state [S, H, D, D] fp32
    contiguous, cu_seqlens / slots / accepted int32. Returns (conv_state, state), updated in place."""
    T, H, D = k.shape
    B = slots.shape[0]
    if B > 0 and T > 0:
        BV = min(32, D)
        K1 = conv_state.shape[2]
        _kda_verify_commit_kernel[(B, H, triton.cdiv(D, BV))](
            x, k, v, g, beta, conv_state, state, cu_seqlens, slots, accepted,
            x.stride(0), k.stride(0), v.stride(0), conv_state.stride(0), conv_state.stride(1), state.stride(0),
            H=H, D=D, BV=BV, K1=K1, K1P=triton.next_power_of_2(K1), num_warps=4,
        )
    return conv_state, state
