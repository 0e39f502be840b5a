"""The bookkeeping every target needs to turn the runtime's `StepBatch` into the arguments the attention and KDA
entries take (not a kernel entry: targets never import each other, so what both need lives here)."""

from __future__ import annotations

from itertools import accumulate

import torch

from kestrel.catalog.attention.mla_gather import MlaGather

MAX_VERIFY = 8   # segments up to this long use the token-by-token KDA kernel and the absorbed MLA decode


class StepPlan:
    """Per-step index tensors the kernels share across layers, built once per step from the StepBatch.

    KDA waves: a request may bring several segments in one step (its prompt chunk cut at page boundaries that
    want a prefix-cache snapshot); a kernel launch must not see one state slot twice, so segments run in waves
    (the k-th segment of every request in wave k), each followed by its snapshot copies."""

    def __init__(self, batch, page_size: int):
        dev = batch.token_ids.device
        cu = batch.cu_seqlens
        lens = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
        self.max_len = max(lens)
        self.req_idx = torch.repeat_interleave(torch.arange(len(lens), device=dev, dtype=torch.int32),
                                               torch.tensor(lens, device=dev))
        self.kv_lens = (batch.positions + 1).to(torch.int32)
        kv_total = [ctx + n for ctx, n in zip(batch.context_lens, lens)]
        self.num_splits = 1 if max(kv_total) < 8192 else 8
        self.cu_q = torch.tensor(cu, dtype=torch.int32, device=dev)
        self.cu_k = torch.tensor([0] + list(accumulate(kv_total)), dtype=torch.int32, device=dev)
        if self.max_len > MAX_VERIFY:
            self.ctx_rows = MlaGather.row_index_for(batch.block_tables, kv_total, page_size, dev)
        self.kda_waves = self._waves(batch, lens, dev)

    @staticmethod
    def _waves(batch, lens, dev):
        slots = batch.slot_list
        snap_of = dict(batch.snapshots)
        seen: dict[int, int] = {}
        wave_of = []
        for s in slots:
            wave_of.append(seen.get(s, 0))
            seen[s] = wave_of[-1] + 1
        waves = []
        for w in range(max(wave_of) + 1):
            segs = [b for b, wb in enumerate(wave_of) if wb == w]
            snaps = [(slots[b], snap_of[b]) for b in segs if b in snap_of]
            if len(segs) == len(lens):
                rows = None
            else:
                rows = torch.cat([torch.arange(batch.cu_seqlens[b], batch.cu_seqlens[b + 1], device=dev) for b in segs])
            cu = torch.tensor([0] + list(accumulate(lens[b] for b in segs)), dtype=torch.int32, device=dev)
            waves.append((rows, cu, torch.tensor([slots[b] for b in segs], dtype=torch.int32, device=dev), snaps))
        return waves

