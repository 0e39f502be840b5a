"""The n-gram proposer (prompt lookup): no weights, the request's own tokens are the draft model.

For a request whose tokens end in ... x1 .. xn, find the latest earlier place where the same n tokens occur and
propose the tokens that followed them there, up to K. n runs from `prompt_lookup_max` down to `prompt_lookup_min`
(vLLM's names): the longest suffix that occurs earlier wins. When the match sits near the end and fewer than K
tokens follow it, only those are proposed (`DraftBlock.lengths`): padding with guesses would cost verify rows that
are almost never accepted. A request with no match proposes nothing and decodes plainly this step.

Drafts are greedy guesses (q one-hot on the token), so sampled requests accept a draft with probability p(draft).
"""

from __future__ import annotations

import numpy as np
import torch

from kestrel.spec.proposer import DraftBlock, DraftInput, Proposer


def ngram_lookup(tokens, k: int, n_max: int, n_min: int) -> list[int]:
    """The up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of
    n_max..n_min tokens; [] when none occurs."""
    arr = np.asarray(tokens, dtype=np.int64)
    L = arr.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n:]
        # windows that start at 0 .. L-n-1: each ends before the suffix's own last token, so something follows
        windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, num_tokens: int, prompt_lookup_max: int = 5, prompt_lookup_min: int = 2):
        self.num_tokens, self.n_max, self.n_min = num_tokens, prompt_lookup_max, prompt_lookup_min

    def propose(self, inputs: list[DraftInput], block_tables=None, pools=None) -> DraftBlock:
        K = self.num_tokens
        found = [ngram_lookup(x.token_ids, K, self.n_max, self.n_min) for x in inputs]
        tokens = torch.zeros(len(inputs), K, dtype=torch.long)
        for b, f in enumerate(found):
            if f:
                tokens[b, :len(f)] = torch.tensor(f)
        return DraftBlock(tokens, lengths=[len(f) for f in found])
