"""Turning logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Each request owns a `torch.Generator`, so its draws do not depend on which other requests share the step: the same
seed gives the same output alone or in any batch. A draw is the exponential race (argmax of p / Exp(1)), which
samples exactly from p with one random vector per request.
"""

from __future__ import annotations

import torch

from kestrel.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature with each row's top-k, top-p and min-p applied (rows of greedy requests are
    left unfiltered: they are never drawn from)."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=logits.device)
    probs = (logits.float() / temps.unsqueeze(1)).softmax(-1)
    V = probs.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=logits.device)
    top_p = torch.tensor([float(p.top_p) for p in params], device=logits.device)
    min_p = torch.tensor([float(p.min_p) for p in params], device=logits.device)
    if bool((top_k < V).any()) or bool((top_p < 1).any()):
        sorted_p, order = probs.sort(-1, descending=True)
        rank = torch.arange(V, device=logits.device).unsqueeze(0)
        # keep a token while the mass before it is below top_p (the first token is always kept)
        before = sorted_p.cumsum(-1) - sorted_p
        drop = (rank >= top_k.unsqueeze(1)) | (before >= top_p.unsqueeze(1))
        sorted_p = sorted_p.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values, 0)
    return probs / probs.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """One token per row of logits [N, V]."""
    out = logits.argmax(-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        probs = filtered_probs(logits[random_rows], [params[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            race = torch.empty(probs.shape[1], device="cpu").exponential_(generator=generators[i])
            out[i] = (probs[j].cpu() / race).argmax()
    return out.tolist()


def logprobs_of(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """(logprob of the chosen token, top_n alternatives) per row, from the unfiltered distribution."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    if top_n:
        vals, ids = lp.topk(top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in tokens]
    return list(zip(chosen, tops))
