"""KDA speculative verify commit (replay): advance each verify block's conv and recurrent state over its accepted
tokens only, from the state the block was verified against (the verify left the slot untouched).

Request b (block rows cu[b]:cu[b+1], state slot slots[b], n = accepted[b] <= block length), head h, t < n:
    k_t, v_t = silu(causal conv (width K) of [conv_state[slot] ++ x[bos:bos + n]]) at token t       (fp32)
    S <- S * exp(g_t)[:, None] ;  S <- S + beta_t * k_t (v_t - S^T k_t)^T                  (k L2-normalized)
    conv_state[slot, c, :] <- the last K-1 entries of conv_state[slot, c, :] ++ x[bos:bos + n, c]
The keys and values are recomputed from the conv inputs in fp32, as the fused decode kernel computes them, so the
committed state is the one plain decode of the accepted tokens leaves (and the replay keeps x, g and beta only).
Two launches: the recurrence (one program per (request, head, v-tile), its [D, BV] slice of S in registers) reads
the old conv state of the head's k channels from every v-tile, so the conv-state shift runs after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.kda._common import _sum_combine


@triton.jit
def _kda_verify_commit_kernel(
    x_ptr, w_ptr, g_ptr, beta_ptr, conv_ptr, state_ptr, cu_ptr, slots_ptr, n_ptr,
    stride_x_t, stride_c_slot, stride_c_c, stride_s_slot,
    H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BV: tl.constexpr, KW: tl.constexpr, K1: tl.constexpr,
    K1P: tl.constexpr, SHIFT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_v = tl.program_id(2)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    n = tl.load(n_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    dk = tl.arange(0, D)
    dv = pid_v * BV + tl.arange(0, BV)
    j = tl.arange(0, K1P)
    live = j < K1
    cs = conv_ptr + slot * stride_c_slot
    if SHIFT:
        # column j of the new conv state is entry n + j of [old K-1 columns ++ the n accepted inputs]
        src = n + j
        from_old = live & (src < K1)
        from_x = live & (src >= K1)
        row = bos + (src - K1).to(tl.int64)
        for sec in tl.static_range(3):
            c = sec * W + h * D + dv
            c_ptrs = cs + c[:, None] * stride_c_c
            old = tl.load(c_ptrs + src[None, :], mask=from_old[None, :], other=0.0)
            new = tl.load(x_ptr + row[None, :] * stride_x_t + c[:, None], mask=from_x[None, :], other=0.0)
            tl.store(c_ptrs + j[None, :], tl.where(from_old[None, :], old, new.to(old.dtype)), mask=live[None, :])
    else:
        ck = W + h * D + dk
        cv = 2 * W + h * D + dv
        wk = tl.load(w_ptr + ck[:, None] * KW + j[None, :], mask=live[None, :], other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + cv[:, None] * KW + j[None, :], mask=live[None, :], other=0.0).to(tl.float32)
        wk_cur = tl.load(w_ptr + ck * KW + K1).to(tl.float32)
        wv_cur = tl.load(w_ptr + cv * KW + K1).to(tl.float32)
        s_ptrs = state_ptr + slot * stride_s_slot + h * D * D + dk[:, None] * D + dv[None, :]
        S = tl.load(s_ptrs)
        for i in range(0, n):
            t64 = bos + i
            # the window before token i: entries i .. i+K-2 of [old state ++ x]
            src = i + j
            from_old = live & (src < K1)
            from_x = live & (src >= K1)
            row = bos + (src - K1).to(tl.int64)
            hk = tl.where(from_old[None, :],
                          tl.load(cs + ck[:, None] * stride_c_c + src[None, :], mask=from_old[None, :], other=0.0),
                          tl.load(x_ptr + row[None, :] * stride_x_t + ck[:, None], mask=from_x[None, :], other=0.0))
            hv = tl.where(from_old[None, :],
                          tl.load(cs + cv[:, None] * stride_c_c + src[None, :], mask=from_old[None, :], other=0.0),
                          tl.load(x_ptr + row[None, :] * stride_x_t + cv[:, None], mask=from_x[None, :], other=0.0))
            k = tl.reduce(hk.to(tl.float32) * wk, 1, _sum_combine) \
                + tl.load(x_ptr + t64 * stride_x_t + ck).to(tl.float32) * wk_cur
            v = tl.reduce(hv.to(tl.float32) * wv, 1, _sum_combine) \
                + tl.load(x_ptr + t64 * stride_x_t + cv).to(tl.float32) * wv_cur
            k = k / (1.0 + tl.exp(-tl.maximum(k, -88.0)))                 # silu; the clamp keeps exp finite
            v = v / (1.0 + tl.exp(-tl.maximum(v, -88.0)))
            g = tl.load(g_ptr + (t64 * H + h) * D + dk)
            beta = tl.load(beta_ptr + t64 * H + h)
            k = k / tl.sqrt(tl.reduce(k * k, 0, _sum_combine) + 1e-6)
            S = S * tl.exp(g)[:, None]
            u = beta * (v - tl.reduce(S * k[:, None], 0, _sum_combine))
            S = S + k[:, None] * u[None, :]
        tl.store(s_ptrs, S)


def kda_verify_commit(x: torch.Tensor, weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      conv_state: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                      accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 3*H*D] conv inputs (unit channel stride), weight [3*H*D, K] contiguous, g [T, H, D] fp32, beta [T, H]
    fp32, conv_state [S, 3*H*D, K-1] (unit column stride), state [S, H, D, D] fp32 contiguous, cu_seqlens / slots /
    accepted int32. Returns (conv_state, state), updated in place."""
    T, H, D = g.shape
    B = slots.shape[0]
    if B > 0 and T > 0:
        BV = min(32, D)
        KW = weight.shape[1]
        for shift in (False, True):
            _kda_verify_commit_kernel[(B, H, triton.cdiv(D, BV))](
                x, weight, g, beta, conv_state, state, cu_seqlens, slots, accepted,
                x.stride(0), conv_state.stride(0), conv_state.stride(1), state.stride(0),
                H=H, D=D, W=H * D, BV=BV, KW=KW, K1=KW - 1, K1P=triton.next_power_of_2(KW - 1), SHIFT=shift,
                num_warps=4,
            )
    return conv_state, state
