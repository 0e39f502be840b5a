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


def merge_attention_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of R disjoint key shards, from each shard's own attention.
    outs [R, T, H, D]: each shard's output, normalized over its own keys; lses [R, T, H]: each shard's natural
    log-sum-exp of the scores, -inf for a shard with no visible key (its output is then ignored, whatever it holds).
    Returns fp32 [T, H, D] = sum_r exp(lse_r - L) outs_r with L = logsumexp_r lse_r: exactly the attention over all
    the keys (Helix's merge across KV ranks; split-K decoding's second stage). A row no shard sees gives 0."""
    lse = lses.float()
    m = lse.max(dim=0).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))      # every shard empty: weights 0, not NaN
    w = torch.exp(lse - m)                                           # an empty shard: exp(-inf) = 0
    total = w.sum(dim=0)
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    terms = torch.where((w > 0).unsqueeze(-1), w.unsqueeze(-1) * outs.float(), torch.zeros((), device=outs.device))
    return terms.sum(dim=0)
