"""KDA (Kimi delta attention) in plain torch: the short conv, the gates and the delta-rule recurrence.

The core forms take a group of B requests that bring L tokens each (`[B, L, ...]`, the state of each passed in and
the new state returned): the reference model calls them on its request groups. The `_varlen` forms take the
runtime's layouts (a flat token batch split by `cu_seqlens`, state pools indexed by `slots`, updated in place) and
run the core form per segment: the catalog's KDA entries compare their kernels with them. `chunk_recurrence_varlen`
is the same recurrence evaluated chunk by chunk, the fast CPU path of the chunked-prefill entry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6       # q / k normalization, as fla computes it


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, in fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gates(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor,
          lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel log decay g [T, H, D] fp32 (<= 0) and beta = sigmoid(b) [T, H] fp32, from f [T, H*D],
    A_log [H], dt_bias [H*D], b [T, H]. Kimi Linear (lower_bound None): g = -exp(A_log) * softplus(f + dt_bias);
    K3: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))."""
    T, H = f.shape[0], A_log.numel()
    x = f.float().reshape(T, H, -1) + dt_bias.float().view(H, -1)
    a = A_log.float().exp().view(H, 1)
    g = -a * F.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(a * x)
    return g, torch.sigmoid(b.float())


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv (width K) + SiLU, continuing from the state. x [B, L, C], weight [C, K], state
    [B, C, K-1] (column K-2 the most recent input). Returns (y [B, L, C] fp32, new state [B, C, K-1] in state's
    dtype: the last K-1 inputs)."""
    K = weight.shape[1]
    window = torch.cat([state.float().transpose(1, 2), x.float()], dim=1)            # [B, K-1+L, C]
    y = (window.unfold(1, K, 1) * weight.float()).sum(-1)                             # [B, L, C, K] -> [B, L, C]
    return F.silu(y), window[:, window.shape[1] - (K - 1):].transpose(1, 2).to(state.dtype)


def recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA delta rule token by token (fla's naive form), fp32. q, k, v, g: [B, L, H, D]; beta: [B, L, H];
    state [B, H, Dk, Dv]. q, k are L2-normalized, q scaled by D^-0.5; per token
    S = S * exp(g)[:, None]; S = S + beta k (v - S^T k)^T; o = S^T q. Returns (o [B, L, H, Dv] fp32, final S)."""
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    k = l2_normalize(k)
    v, g, beta, state = v.float(), g.float(), beta.float(), state.float()
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp().unsqueeze(-1)
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - predicted)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, state


# ------------------------------------------------------------------------------------ runtime layouts (varlen)

def _segments(cu_seqlens: torch.Tensor, slots: torch.Tensor) -> list[tuple[int, int, int]]:
    cu = cu_seqlens.tolist()
    return [(cu[b], cu[b + 1], s) for b, s in enumerate(slots.tolist())]


def short_conv_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                      slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv` over a flat batch x [T, C]: out [T, C] fp32; conv_state [S, C, K-1] updated in place."""
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for bos, eos, slot in _segments(cu_seqlens, slots):
        yb, new = short_conv(x[None, bos:eos], weight, conv_state[slot][None])
        y[bos:eos] = yb[0]
        conv_state[slot] = new[0]
    return y, conv_state


def recurrence_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, cu_seqlens: torch.Tensor,
                      slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrence` over a flat batch (q, k, v, g [T, H, D], beta [T, H]) from the state pool [S, H, D, D]:
    o [T, H, D] fp32; the pool updated in place."""
    o = torch.empty(q.shape[:2] + v.shape[2:], dtype=torch.float32, device=q.device)
    for bos, eos, slot in _segments(cu_seqlens, slots):
        ob, final = recurrence(q[None, bos:eos], k[None, bos:eos], v[None, bos:eos], g[None, bos:eos],
                               beta[None, bos:eos], state[slot][None])
        o[bos:eos] = ob[0]
        state[slot] = final[0].to(state.dtype)
    return o, state


def chunk_recurrence_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                            chunk_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrence_varlen` evaluated chunk by chunk (see kernels/kda/chunk.py for the algebra): vectorized within
    a chunk, exact pairwise decay exponents, a triangular solve; agrees with the token loop to fp32 rounding.
    Returns o [T, H, D] fp32 and the state pool (updated in place)."""
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
    return o, state



def commit_varlen(x: torch.Tensor, weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  conv_state: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                  accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative verify with replay: advance request b's conv and recurrent state over the first `accepted[b]`
    tokens of its block (rows cu[b]:cu[b+1]) only, from the states the block was verified against: `short_conv`
    of those conv inputs x [T, 3*H*D] (weight [3*H*D, K]) from the conv state, then `recurrence` over their keys
    and values with the gates g [T, H, D], beta [T, H] (q plays no part in the state). The same math as decoding
    the n tokens one by one. Pools updated in place and returned."""
    H, D = g.shape[1], g.shape[2]
    W = H * D
    for (bos, _eos, slot), n in zip(_segments(cu_seqlens, slots), accepted.tolist()):
        if n == 0:
            continue
        y, conv_state[slot:slot + 1] = short_conv(x[None, bos:bos + n], weight, conv_state[slot:slot + 1])
        k, v = y[..., W:2 * W].view(1, n, H, D), y[..., 2 * W:].view(1, n, H, D)
        _, final = recurrence(k, k, v, g[None, bos:bos + n], beta[None, bos:bos + n], state[slot][None])
        state[slot] = final[0].to(state.dtype)
    return conv_state, state
