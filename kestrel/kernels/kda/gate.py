"""KDA per-channel log-decay gate and the fused beta sigmoid.

    Kimi Linear (lower_bound None): g[t, h, d] = -exp(A_log[h]) * softplus(f[t, h*D + d] + dt_bias[h*D + d])
    K3 (lower_bound lb < 0):        g[t, h, d] = lb * sigmoid(exp(A_log[h]) * (f[t, h*D + d] + dt_bias[h*D + d]))
    beta[t, h] = sigmoid(b[t, h])
g and beta are fp32 whatever the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(x):
    # torch's softplus (threshold 20), with log1p(e) evaluated as log(u) * e / (u - 1), u = 1 + e, which keeps
    # full relative precision where e = exp(x) is small (no tl.log1p in every Triton version).
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    um1 = u - 1.0
    lp = tl.where(um1 == 0.0, e, tl.log(u) * (e / tl.where(um1 == 0.0, 1.0, um1)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _kda_gate_kernel(
    f_ptr, a_log_ptr, dt_bias_ptr, b_ptr, g_ptr, beta_ptr,
    lower_bound, T,
    stride_f_t, stride_b_t,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, USE_LB: tl.constexpr,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    d = tl.arange(0, BD)
    mt = t < T
    md = d < D
    t64 = t.to(tl.int64)
    m = mt[:, None] & md[None, :]
    f = tl.load(f_ptr + t64[:, None] * stride_f_t + h * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    bias = tl.load(dt_bias_ptr + h * D + d, mask=md, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    x = f + bias[None, :]
    # sigmoid(z) = 1 / (1 + exp(-z)), z clamped at -88 so exp stays finite (sigmoid(-88) ~ 6e-39 anyway)
    if USE_LB:
        g = lower_bound / (1.0 + tl.exp(-tl.maximum(a * x, -88.0)))
    else:
        g = -a * _softplus(x)
    tl.store(g_ptr + (t64[:, None] * H + h) * D + d[None, :], g, mask=m)
    bb = tl.load(b_ptr + t64 * stride_b_t + h, mask=mt, other=0.0).to(tl.float32)
    tl.store(beta_ptr + t64 * H + h, 1.0 / (1.0 + tl.exp(-tl.maximum(bb, -88.0))), mask=mt)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor,
             lower_bound: float | None = None, g_out: torch.Tensor | None = None,
             beta_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """f [T, H*D] and b [T, H] (unit stride along the last dim), A_log [H] fp32, dt_bias [H*D] fp32.
    Returns g [T, H, D] fp32 and beta [T, H] fp32 (written into g_out / beta_out when given)."""
    T = f.shape[0]
    H = A_log.numel()
    D = f.shape[1] // H
    if g_out is None:
        g_out = torch.empty((T, H, D), dtype=torch.float32, device=f.device)
    if beta_out is None:
        beta_out = torch.empty((T, H), dtype=torch.float32, device=f.device)
    if T > 0:
        BT = min(32, triton.next_power_of_2(T))
        _kda_gate_kernel[(triton.cdiv(T, BT), H)](
            f, A_log, dt_bias, b, g_out, beta_out,
            float(lower_bound) if lower_bound is not None else 0.0, T,
            f.stride(0), b.stride(0),
            H=H, D=D, BT=BT, BD=triton.next_power_of_2(D), USE_LB=lower_bound is not None, num_warps=4,
        )
    return g_out, beta_out
