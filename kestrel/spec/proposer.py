"""The interface between the runtime and a speculative proposer.

A step of a speculating request feeds the target a block of K + 1 tokens: the last sampled token and the K draft
tokens the proposer guessed after it. The target scores the block in one step (verify), acceptance keeps the
longest prefix the target agrees with plus one token of its own, and the rest is thrown away (MLA pages released,
KDA state committed at the last accepted position).

The runtime talks to a proposer only through this class:
- `observe` after every target step that computed tokens of speculating requests (prefill chunks and verify
  blocks alike), with the target's hidden states at `capture_layers`, so a drafter can write the KV of those
  positions into its own layers of the shared cache pools (layer ids `extra_layers`, appended after the target's);
  positions past the accepted ones are overwritten later, never read.
- `propose` once per step for the speculating requests that are decoding, returning K draft tokens each and, for
  sampled requests, the draft distribution q the tokens were drawn from (lossless acceptance needs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class DraftInput:
    """What a proposer may read of one request when it proposes."""
    # prompt + output so far; the last one is the token the block starts with (a proposer whose `reads_history` is
    # False gets that last token alone: copying a long context per request and step is host time for nothing)
    token_ids: Sequence[int]
    position: int                 # position of that last token (= tokens already in the cache)
    slot: int                     # the request's KDA slot = its row of the block table
    seed: int                     # the request's sampling seed (draws keyed by (seed, position) like the sampler)
    temperature: float            # 0: greedy (q is one-hot and may be omitted)


@dataclass
class DraftBlock:
    """A propose's result. Its tensors may be views of a proposer's static buffers (a replayed propose graph): read
    them before the next propose."""
    tokens: torch.Tensor                # [B, K] int64 draft tokens after each request's last token
    probs: torch.Tensor | None = None   # [B, K, V] fp32 draft distribution q of each token; None: one-hot on tokens
    confidence: torch.Tensor | None = None  # [B, K] fp32 the drafter's estimate that each token is accepted (DSpark)
    # how many leading tokens of each row are real drafts (the rest is padding, never verified); None: all K.
    # A proposer that found nothing for a request gives it 0: that request decodes plainly this step.
    lengths: list[int] | None = None


class Proposer:
    method: str = ""
    num_tokens: int = 1                       # K, the draft tokens per step (the verify block is K + 1)
    capture_layers: tuple[int, ...] = ()      # target layers whose output hidden states `observe` wants
    extra_layers: tuple[int, ...] = ()        # MLA layer ids the proposer adds to the target's cache pools
    reads_history: bool = True                # whether propose reads DraftInput.token_ids beyond the last one
    # padded proposes (CUDA graphs, runtime/graphs.py): the batch buckets `pad_to` set up (empty: none), and the
    # graph captured per bucket, which `propose` replays over the static inputs it fills
    buckets: list[int] = []
    graphs: dict = {}
    # whether `observe` may be captured into the target's step graphs (it then runs inside each replay)
    observe_capturable: bool = False

    def observe(self, batch, hidden: dict[int, torch.Tensor], pools) -> None:
        """After a target step: `batch` is the step's StepBatch, `hidden[l]` the [T, hidden] output of target layer l
        for every row of the batch, `pools` the shared CachePools. The default keeps nothing (n-gram)."""

    def propose(self, inputs: list[DraftInput], block_tables: torch.Tensor, pools) -> DraftBlock:
        raise NotImplementedError(f"{type(self).__name__} must implement propose")

    def pad_to(self, buckets: list[int], block_tables: torch.Tensor, scratch_row: int) -> None:
        """Called by the runner where padded steps are on: set up static buffers for proposes of up to
        buckets[-1] requests over `block_tables`, padded to a bucket with rows on `scratch_row` (it names only the
        scratch page), and set `buckets`; then the runner may capture `run_padded(n, pools)` after
        `fill_padding(n)` per bucket into `graphs[n]` (a proposer that sets `buckets` has both). The default (host
        work only: n-gram) keeps none."""

