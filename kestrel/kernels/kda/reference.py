"""Plain-torch KDA: the executable spec of the kernels in this package, fp32 math, any device.

- `short_conv_reference`, `kda_gate_reference`: direct transcriptions of the formulas.
- `kda_naive_recurrence`: the token-by-token recurrence (the ground truth for decode and prefill alike).
- `kda_chunk_reference`: the same recurrence evaluated chunk by chunk (vectorized within a chunk, exact pairwise
  decay exponents, triangular solve), the fast CPU path; agrees with the naive loop to fp32 rounding.
All of them take the runtime's layouts: a flat token batch split by `cu_seqlens`, state pools indexed by `slots`,
and update the pools in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, in fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _segments(cu_seqlens: torch.Tensor, slots: torch.Tensor) -> list[tuple[int, int, int]]:
    cu = cu_seqlens.tolist()
    return [(cu[b], cu[b + 1], s) for b, s in enumerate(slots.tolist())]


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                         slots: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [T, C] fp32 = silu(causal depthwise conv of (state ++ segment)); conv_state updated in place."""
    T, C = x.shape
    KW = weight.shape[1]
    w = weight.float()
    y = torch.empty((T, C), dtype=torch.float32, device=x.device)
    for bos, eos, slot in _segments(cu_seqlens, slots):
        xx = torch.cat([conv_state[slot].float(), x[bos:eos].float().t()], dim=1)     # [C, K-1 + n]
        y[bos:eos] = (xx.unfold(1, KW, 1) * w[:, None, :]).sum(-1).t()            # [C, n, K] -> [n, C]
        conv_state[slot] = xx[:, xx.shape[1] - (KW - 1):].to(conv_state.dtype)
    return F.silu(y), conv_state


def kda_gate_reference(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor,
                       lower_bound: float | None = None, g_out: torch.Tensor | None = None,
                       beta_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """g [T, H, D] fp32 (Kimi Linear softplus form, or K3 lower-bound sigmoid form) and beta = sigmoid(b) fp32."""
    T = f.shape[0]
    H = A_log.numel()
    x = f.float().view(T, H, -1) + dt_bias.float().view(H, -1)
    a = A_log.float().exp().view(H, 1)
    if lower_bound is None:
        g = -a * F.softplus(x)
    else:
        g = lower_bound * torch.sigmoid(a * x)
    return g, torch.sigmoid(b.float())


def kda_naive_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, all heads at once: S = S * exp(g)[:, None]; S += beta k (v - S^T k)^T; o = S^T q.
    Returns o [T, H, D] fp32 and the state pool (updated in place)."""
    T, H, D = q.shape
    qn = l2_normalize(q) * D ** -0.5
    kn = l2_normalize(k)
    vf, gf, bf = v.float(), g.float(), beta.float()
    o = torch.empty((T, H, D), dtype=torch.float32, device=q.device)
    for bos, eos, slot in _segments(cu_seqlens, slots):
        S = state[slot].float().clone()                                   # [H, Dk, Dv]
        for t in range(bos, eos):
            S = S * gf[t].exp()[:, :, None]
            kv = torch.einsum("hkv,hk->hv", S, kn[t])
            S = S + torch.einsum("hk,hv->hkv", kn[t], bf[t][:, None] * (vf[t] - kv))
            o[t] = torch.einsum("hkv,hk->hv", S, qn[t])
        state[slot] = S.to(state.dtype)
    return o, state


def kda_chunk_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                        out: torch.Tensor | None = None, chunk_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence chunk by chunk (see kernels/kda/chunk.py for the algebra), fp32, exact pairwise decays.
    Returns o [T, H, D] (fp32, or written into `out` in its dtype) and the state pool (updated in place)."""
    T, H, D = q.shape
    qn = l2_normalize(q) * D ** -0.5
    kn = l2_normalize(k)
    vf, gf, bf = v.float(), g.float(), beta.float()
    o = torch.empty((T, H, D), dtype=torch.float32, device=q.device)
    for bos, eos, slot in _segments(cu_seqlens, slots):
        S = state[slot].float().clone()                                   # [H, Dk, Dv]
        for c0 in range(bos, eos, chunk_size):
            c1 = min(c0 + chunk_size, eos)
            n = c1 - c0
            qc, kc, vc = (x[c0:c1].transpose(0, 1) for x in (qn, kn, vf))  # [H, n, D]
            G = gf[c0:c1].transpose(0, 1).cumsum(1)                        # [H, n, D]
            bc = bf[c0:c1].t()                                             # [H, n]
            incl = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            diff = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~incl[None, :, :, None], float("-inf"))
            E = diff.exp()                                                 # [H, t, s, D], exp(G_t - G_s), s <= t
            akk = torch.einsum("htd,hsd,htsd->hts", kc, kc, E).tril(-1)
            aqk = torch.einsum("htd,hsd,htsd->hts", qc, kc, E)
            eg = G.exp()
            rhs = bc[..., None] * (vc - (kc * eg) @ S)
            lhs = torch.eye(n, device=q.device) + bc[..., None] * akk
            u = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
            o[c0:c1] = ((qc * eg) @ S + aqk @ u).transpose(0, 1)
            gn = G[:, -1:, :]                                              # [H, 1, D]
            S = S * gn.transpose(1, 2).exp() + (kc * (gn - G).exp()).transpose(1, 2) @ u
        state[slot] = S.to(state.dtype)
    if out is not None:
        out.copy_(o)
        return out, state
    return o, state
