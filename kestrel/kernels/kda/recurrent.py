"""KDA recurrent step for decode and speculative verify: 1..N tokens per request, state pool updated in place.

Per request b (tokens cu[b]:cu[b+1], state slot slots[b]) and head h, for each token in order:
    q <- q / sqrt(sum(q^2) + 1e-6) * D^-0.5 ;  k <- k / sqrt(sum(k^2) + 1e-6)      (fp32)
    S <- S * exp(g)[:, None] ;  S <- S + beta * k (v - S^T k)^T ;  o = S^T q
with S = state[slot, h] ([D_k, D_v], fp32), written back at the end unless the call is a verify's (`update=False`).
One program per (request, head, v-tile) keeps its [D, BV] slice of S in registers across
the request's tokens: the columns of S evolve independently given q, k, g, beta.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.kda._common import _sum_combine


@triton.jit
def _kda_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, cu_ptr, slots_ptr,
    stride_q_t, stride_k_t, stride_v_t, stride_s_slot,
    scale,
    H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, UPDATE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_v = tl.program_id(2)
    bos = tl.load(cu_ptr + b)
    eos = tl.load(cu_ptr + b + 1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    dk = tl.arange(0, D)
    dv = pid_v * BV + tl.arange(0, BV)
    s_ptrs = state_ptr + slot * stride_s_slot + h * D * D + dk[:, None] * D + dv[None, :]
    S = tl.load(s_ptrs)
    for i in range(0, eos - bos):
        t64 = bos.to(tl.int64) + i
        q = tl.load(q_ptr + t64 * stride_q_t + h * D + dk).to(tl.float32)
        k = tl.load(k_ptr + t64 * stride_k_t + h * D + dk).to(tl.float32)
        v = tl.load(v_ptr + t64 * stride_v_t + h * D + dv).to(tl.float32)
        g = tl.load(g_ptr + (t64 * H + h) * D + dk)
        beta = tl.load(beta_ptr + t64 * H + h)
        q = q * (scale / tl.sqrt(tl.reduce(q * q, 0, _sum_combine) + 1e-6))
        k = k / tl.sqrt(tl.reduce(k * k, 0, _sum_combine) + 1e-6)
        S = S * tl.exp(g)[:, None]
        u = beta * (v - tl.reduce(S * k[:, None], 0, _sum_combine))
        S = S + k[:, None] * u[None, :]
        o = tl.reduce(S * q[:, None], 0, _sum_combine)
        tl.store(o_ptr + (t64 * H + h) * D + dv, o.to(o_ptr.dtype.element_ty))
    if UPDATE:
        tl.store(s_ptrs, S)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                  out: torch.Tensor | None = None, update: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v [T, H, D] (heads and D contiguous; any token stride), g [T, H, D] fp32, beta [T, H] fp32,
    state [S, H, D, D] fp32 contiguous. Returns (o [T, H, D] in v's dtype, state); `update=False` leaves the
    state as it was (a speculative verify block: the state advances later, over the accepted tokens only)."""
    T, H, D = q.shape
    B = slots.shape[0]
    if out is None:
        out = torch.empty((T, H, D), dtype=v.dtype, device=v.device)
    if B > 0 and T > 0:
        BV = min(32, D)
        _kda_recurrent_kernel[(B, H, triton.cdiv(D, BV))](
            q, k, v, g, beta, state, out, cu_seqlens, slots,
            q.stride(0), k.stride(0), v.stride(0), state.stride(0),
            D ** -0.5,
            H=H, D=D, BV=BV, UPDATE=update, num_warps=4,
        )
    return out, state
