"""The MoE ops in plain torch: the sigmoid router, the gated activations (SiLU-GLU, K3's SiTU-GLU) and the routed
experts' weighted sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, weight: torch.Tensor, e_score_correction_bias: torch.Tensor | None, top_k: int,
          n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
          routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 logits x W^T, s = sigmoid(logits); experts chosen by top-k of choice = s + bias (within the
    topk_group best groups when grouped, a group scored by its two best choices); weights = the unbiased s of
    the chosen, renormalized to sum 1 if norm_topk_prob, times routed_scaling_factor.
    Returns (topk_ids int32 [T, k], topk_weights fp32 [T, k], choice fp32 [T, E] after the group mask)."""
    s = torch.sigmoid(x.float() @ weight.float().t())
    choice = s if e_score_correction_bias is None else s + e_score_correction_bias.float()
    T, E = choice.shape
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(T, n_group, E // n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices
    w = s.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), w * routed_scaling_factor, choice


def glu(gate: torch.Tensor, up: torch.Tensor, act: str, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """'silu': silu(g) * u; 'situ' (K3): beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta).
    fp32 math, output in gate's dtype."""
    g, u = gate.float(), up.float()
    if act == "silu":
        y = F.silu(g) * u
    elif act == "situ":
        y = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    else:
        raise ValueError(f"unknown GLU activation {act!r}")
    return y.to(gate.dtype)


def experts(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: str,
            beta: float = 4.0, linear_beta: float = 25.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * w2[e] @ glu(w13[e] @ x[t]) with e = topk_ids[t, j], accumulated in
    fp32 ([T, H] fp32). w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], or anything whose [e] is expert
    e's weight; the two matmuls and the activation's output run in `dtype` (default x's). An id < 0 is skipped
    (an expert another rank holds, under expert parallelism)."""
    dtype = dtype or x.dtype
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in ids.unique().tolist():
        if e < 0:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[tok].to(dtype) @ w13[e].to(dtype).t()
        inter = gu.shape[-1] // 2
        y = glu(gu[:, :inter], gu[:, inter:], act, beta, linear_beta) @ w2[e].to(dtype).t()
        out.index_add_(0, tok.to(out.device), y.float() * topk_weights[tok, slot, None].float())
    return out
