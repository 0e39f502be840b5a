"""Norms in plain torch: RMSNorm, KDA's gated per-head output norm, and K3's attention-residual mix over depth."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x * rsqrt(mean(x^2) + eps) over the last dim, fp32 math, fp32 result (the caller rounds once)."""
    xf = x.float()
    return weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * sigmoid(gate), rows of one KDA head; fp32 result."""
    return rms_norm(x, weight, eps) * torch.sigmoid(gate.float())


def attn_res_mix(blocks: Sequence[torch.Tensor] | torch.Tensor, partial: torch.Tensor, w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """K3's attention residual, a softmax over depth: over v_i in blocks + [partial] (blocks a list of [T, N] or
    a [NB, T, N] tensor), logit_i = (v_i . w) * rsqrt(mean(v_i^2) + eps), out = sum_i softmax_i(logit) v_i, with
    w = res_norm.weight * res_proj.weight. fp32 math, output in partial's dtype; no blocks returns partial."""
    if len(blocks) == 0:
        return partial
    v = torch.stack([*blocks, partial]).float()                           # [S, T, N]
    logits = (v @ w.float()) * torch.rsqrt(v.pow(2).mean(-1) + eps)       # [S, T]
    return (logits.softmax(0).unsqueeze(-1) * v).sum(0).to(partial.dtype)
