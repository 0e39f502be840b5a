"""Persistent step inputs: the device tensors a model step reads, allocated once and written in place.

Each step copies its token ids, positions, state slot ids, sequence lengths and logits rows into slices of these
buffers (one host tensor, one `copy_` per field) and gathers the block-table rows of its requests, on the device,
from the cache's block table into `block_tables`; the `StepBatch` fields are views of the buffers. So a decode step
(at most `max_num_seqs` single-token segments) always reads the same memory, which is what a CUDA graph captured
for it needs. A step larger than the buffers (a prefill under a very large token budget) gets one-off tensors
instead; decode steps always fit.
"""

from __future__ import annotations

import torch

from kestrel.models.kimi.step import StepBatch

DEFAULT_TOKEN_CAPACITY = 16384


class StepInputs:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, page_size: int, max_pages_per_seq: int,
                 device: torch.device):
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.token_capacity = max(max_num_seqs, min(max_num_batched_tokens, DEFAULT_TOKEN_CAPACITY))
        # segments: every request once, plus the cuts of its prompt chunk at page boundaries (KDA snapshots)
        self.segment_capacity = 2 * max_num_seqs + self.token_capacity // page_size + 1
        self.max_pages_per_seq = max_pages_per_seq
        self.oversize_steps = 0
        T, S, dev = self.token_capacity, self.segment_capacity, self.device
        self.token_ids = torch.zeros(T, dtype=torch.long, device=dev)
        self.positions = torch.zeros(T, dtype=torch.long, device=dev)
        self.slots = torch.zeros(S, dtype=torch.long, device=dev)
        self.context_lens = torch.zeros(S, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(S, dtype=torch.int32, device=dev)     # context + this step's tokens
        self.cu_seqlens = torch.zeros(S + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((S, max_pages_per_seq), -1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.zeros(max(S, 1), dtype=torch.long, device=dev)
        # host staging: on a GPU one pinned buffer, reused (each step ends by reading its sampled tokens back, so
        # the previous step's copies are done before this one writes)
        self._staging = None if dev.type == "cpu" else torch.empty(2 * T + 5 * S + 1, dtype=torch.long,
                                                                   pin_memory=dev.type == "cuda")

    def fill(self, tokens: list[int], positions: list[int], cu: list[int], ctx: list[int], slots: list[int],
             logits_rows: list[int], block_tables: torch.Tensor,
             snapshots: list[tuple[int, int]]) -> StepBatch:
        """Write one step's inputs into the buffers and return the StepBatch of views over them.
        `block_tables` is the cache's device table [num_slots, max_pages], indexed by `slots`."""
        T, B, N = len(tokens), len(slots), len(logits_rows)
        seq_lens = [c + cu[b + 1] - cu[b] for b, c in enumerate(ctx)]
        flat = torch.tensor(tokens + positions + slots + ctx + seq_lens + cu + logits_rows, dtype=torch.long)
        if T > self.token_capacity or B > self.segment_capacity:
            return self._one_off(flat, T, B, N, cu, ctx, block_tables, snapshots, slots)
        if self.device.type == "cpu":
            host = flat
        else:
            host = self._staging[:flat.shape[0]]
            host.copy_(flat)
        o = 0
        for buf, n in ((self.token_ids, T), (self.positions, T), (self.slots, B), (self.context_lens, B),
                       (self.seq_lens, B), (self.cu_seqlens, B + 1), (self.logits_indices, N)):
            buf[:n].copy_(host[o:o + n], non_blocking=True)
            o += n
        slot_v = self.slots[:B]
        bt = self.block_tables[:B]
        torch.index_select(block_tables, 0, slot_v, out=bt)
        return StepBatch(token_ids=self.token_ids[:T], positions=self.positions[:T], cu_seqlens=cu,
                         context_lens=ctx, slots=slot_v, block_tables=bt, logits_indices=self.logits_indices[:N],
                         snapshots=snapshots, host_slots=slots)

    def _one_off(self, host: torch.Tensor, T: int, B: int, N: int, cu: list[int], ctx: list[int],
                 block_tables: torch.Tensor, snapshots: list[tuple[int, int]], host_slots: list[int]) -> StepBatch:
        self.oversize_steps += 1
        dev = host.to(self.device, non_blocking=True)
        slots = dev[2 * T:2 * T + B]
        o = 2 * T + 3 * B + B + 1
        return StepBatch(token_ids=dev[:T], positions=dev[T:2 * T], cu_seqlens=cu, context_lens=ctx, slots=slots,
                         block_tables=block_tables.index_select(0, slots), logits_indices=dev[o:o + N],
                         snapshots=snapshots, host_slots=host_slots)
