"""Softmax attention in plain torch: the one formula behind MLA's expanded (prefill) and absorbed (decode) forms."""

from __future__ import annotations

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the visible keys of scale * q k^T, times v; fp32, batched over leading dims.
    q [..., Lq, D], k [..., Lk, D], v [..., Lk, Dv], visible bool broadcastable to [..., Lq, Lk] (every query sees
    at least one key; None: all keys). Returns (out fp32 [..., Lq, Dv], lse fp32 [..., Lq]: the natural log-sum-exp of the scores).
    MLA's absorbed form is the case of one latent head: the queries are the heads, k the cached latents and v
    their first kv_lora_rank columns."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v.float(), lse
