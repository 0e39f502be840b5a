"""Lossless acceptance of a verify block, for the whole batch on the device.

A speculating request's block is [last token, d_1 .. d_n] (n <= K drafts, the rest of its row padding); target row
i (0..n) scores the token at position pos + i, where pos is the position of d_1. With p_i the target's distribution
at row i after the request's own filters (temperature, top-k, top-p, min-p: exactly what the sampler draws from,
`filtered_probs`) and q_i the draft distribution of d_i (one-hot on d_i when the proposer gives none):

- d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order, until the first rejection;
- at the first rejected row i the token is drawn from the residual max(0, p_i - q_i) (renormalised);
- when all n are accepted, one more token (the bonus) is drawn from p_n.
The emitted tokens are distributed exactly as tokens drawn from the target one by one (the standard speculative
sampling argument). Greedy rows are the same rule with p one-hot on the argmax: the longest matching prefix plus
the target's own next token.

Random numbers are the sampler's counter-based uniforms: the accept test of the draft at position t uses a second
stream of the request's seed (`ACCEPT_SALT`), the residual or bonus draw at position t the sampler's own uniform for
t. So a seeded request's result depends on nothing but its seed, its drafts and its logits, never on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.runtime.sampler import (GREEDY, NUCLEUS, PLAIN, SORTED, TOP_K, TOP_K_CAP, canonical_candidates, draw,
                                     keep_weights, uniforms)

ACCEPT_SALT = 0x5EC0DE5


def filtered_probs(logits: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, paths: frozenset) -> torch.Tensor:
    """The distribution the sampler draws each row of logits [N, V] from, as fp32 probabilities [N, V]: one-hot
    on the argmax for greedy rows, else temperature, top-k (canonical order), top-p, min-p as `sample_rows` applies
    them. `ints` [5, N] / `floats` [3, N] are the sampler's packed rows, `paths` the row paths present."""
    x = logits.float()
    N, V = x.shape
    top_k, path = ints[3], ints[4]
    temperature, top_p, min_p = floats
    out = torch.zeros(N, V, dtype=torch.float32, device=x.device)
    out.scatter_(1, x.argmax(-1, keepdim=True), 1.0)
    if not paths - {GREEDY}:
        return out
    xs = x / temperature.unsqueeze(1)
    if PLAIN in paths:
        out = torch.where((path == PLAIN).unsqueeze(1), torch.softmax(xs, -1), out)
    for here, k in (((TOP_K,), TOP_K_CAP), ((SORTED, NUCLEUS), V)):
        if paths & set(here):
            vals, ids = canonical_candidates(xs, min(k, V))
            w = keep_weights(vals, top_k, top_p, min_p)
            full = torch.zeros_like(out).scatter_(1, ids, (w / w.sum(-1, keepdim=True)).float())
            rows = (path == here[0]) | (path == here[-1])
            out = torch.where(rows.unsqueeze(1), full, out)
    return out


@dataclass
class Accepted:
    tokens: torch.Tensor         # [B, K + 1] int64: the accepted drafts, then the residual / bonus token, then junk
    num_accepted: torch.Tensor   # [B] int64 a: drafts accepted; a + 1 tokens are emitted


def accept(logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, draft_probs: torch.Tensor | None,
           ints: torch.Tensor, floats: torch.Tensor, paths: frozenset) -> Accepted:
    """Acceptance for B blocks at once. logits [B, K + 1, V] (row i scores position pos + i), drafts [B, K] int64,
    lengths [B] int64 (real drafts per row, 1..K), draft_probs [B, K, V] or None (one-hot on the drafts), the
    sampler's packed rows `ints` [5, B] (position field = pos, the position of d_1) / `floats` [3, B]. No host sync
    and no loop over rows."""
    B, R, V = logits.shape
    K = R - 1
    dev = logits.device
    offs = torch.arange(R, device=dev)
    row_ints = ints.unsqueeze(2).expand(5, B, R).clone()
    row_ints[2] += offs                                               # each row's own position
    p = filtered_probs(logits.reshape(B * R, V), row_ints.reshape(5, B * R),
                       floats.unsqueeze(2).expand(3, B, R).reshape(3, B * R), paths).view(B, R, V)
    d = drafts.unsqueeze(-1)
    p_d = p[:, :K].gather(2, d).squeeze(-1).double()                  # [B, K]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(2, d).squeeze(-1).double()
    key0, key1, pos = ints[0], ints[1], ints[2]
    u = uniforms((key0 ^ ACCEPT_SALT).unsqueeze(1), key1.unsqueeze(1), pos.unsqueeze(1) + offs[:K])   # [B, K]
    ok = (u * q_d < p_d) & (offs[:K] < lengths.unsqueeze(1))
    a = ok.long().cumprod(1).sum(1)                                   # [B] drafts accepted
    p_a = p.gather(1, a.view(B, 1, 1).expand(B, 1, V)).squeeze(1)     # [B, V] the target at the first miss
    if draft_probs is None:
        q_a = torch.zeros_like(p_a).scatter_(1, drafts.gather(1, a.clamp(max=K - 1).unsqueeze(1)), 1.0)
    else:
        q_a = draft_probs.gather(1, a.clamp(max=K - 1).view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    rejected = (a < lengths).unsqueeze(1)
    residual = (p_a - q_a).clamp_(min=0)
    # p <= q everywhere would accept every draft: a zero residual only comes from rounding, where p is the answer
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a)
    last = draw(torch.where(rejected, residual, p_a), uniforms(key0, key1, pos + a))
    tokens = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, a.unsqueeze(1), last.unsqueeze(1))
    return Accepted(tokens, a)
