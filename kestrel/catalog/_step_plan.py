"""The bookkeeping every target needs to turn the runtime's `StepBatch` into the arguments the attention and KDA
entries take (not a kernel entry: targets never import each other, so what both need lives here)."""

from __future__ import annotations

from itertools import accumulate

import torch

from kestrel.catalog.attention.mla_gather import MlaGather

MAX_VERIFY = 8   # segments up to this long use the token-by-token KDA kernel and the absorbed MLA decode
# absorbed MLA decode splits the sequence in NUM_SPLITS from this many cached tokens on. Unsplit, a small batch
# leaves the GPU idle: at batch 1 the 32 heads of Kimi Linear make 2 CTAs, each streaming the whole context
# (H200, kl8 at 1K context: 50 us per MLA layer, 9% of the decode step's kernel time; the KV read is 1.2 MB)
SPLIT_KV_LEN = 512
NUM_SPLITS = 8
# a batch of at most SMALL_BATCH requests whose longest context reaches LONG_KV_LEN splits it LONG_SPLITS ways: at
# batch 1 over 4K tokens (32 heads, H200, in a graph) 8 splits took 28.5 us a layer and 32 took 15.2; at 1K, 32
# splits were slower than 8 (14.6 against 11.9: benchmarks/results/h200_decode_small_probe.json). SMALL_BATCH is a
# decode bucket, so a padded step and its bucket's graph agree on the count
LONG_KV_LEN = 2048
LONG_SPLITS = 32
SMALL_BATCH = 4


def num_splits_for(max_kv_len: int, requests: int | None = None) -> int:
    """Split-K count of the absorbed MLA decode for a step of `requests` requests (None: any number) whose longest
    sequence has `max_kv_len` tokens (host arithmetic; a CUDA graph is captured per split count, and eager steps
    use the same rule, so both run the same kernels)."""
    if max_kv_len < SPLIT_KV_LEN:
        return 1
    if requests is not None and requests <= SMALL_BATCH and max_kv_len >= LONG_KV_LEN:
        return LONG_SPLITS
    return NUM_SPLITS


def decode_variant(context_lens: list[int]) -> int:
    """What a decode step's kernels depend on besides its batch size (a CUDA graph is captured per bucket and
    variant): the MLA decode's split count."""
    return num_splits_for(max(context_lens) + 1, len(context_lens))


def decode_variants(max_kv_len: int) -> dict[int, int]:
    """Every decode variant a context of up to `max_kv_len` tokens can need, each with a context length that
    selects it (the capture's padding batch claims that length on the host; its rows still attend to one token).
    LONG_SPLITS is selected by small batches only: the capture skips a (bucket, variant) its batch cannot select."""
    out = {num_splits_for(1): 0}
    if max_kv_len >= SPLIT_KV_LEN:
        out[num_splits_for(SPLIT_KV_LEN)] = SPLIT_KV_LEN - 1
    if max_kv_len >= LONG_KV_LEN:
        out[num_splits_for(LONG_KV_LEN, 1)] = LONG_KV_LEN - 1
    return out


class StepPlan:
    """Per-step index tensors the kernels share across layers, built once per step from the StepBatch.

    No host synchronization: lengths come from the batch's host lists, and the device index tensors from the
    runtime's persistent inputs (`batch.req_idx`, `cu_seqlens_dev`, `cu_kv_dev`) when it provides them. A decode
    step (one token per segment, no snapshot) needs nothing but those and device arithmetic on the positions and
    slots, so its plan is the same kernels on the same buffers every step: capturable in a CUDA graph.

    KDA waves: a request may bring several segments in one step (its prompt chunk cut at page boundaries that
    want a prefix-cache snapshot); a kernel launch must not see one state slot twice, so segments run in waves
    (the k-th segment of every request in wave k), each followed by its snapshot copies."""

    def __init__(self, batch, page_size: int):
        dev = batch.token_ids.device
        cu = batch.cu_seqlens
        B, T = len(cu) - 1, batch.token_ids.shape[0]
        decode = T == B and not batch.snapshots and not batch.verify_segments
        # a pure decode step (one token per request, no snapshot) runs the fused one-token-per-request entries
        self.decode = decode
        # CUDA-graph padding rows all run on the cache's scratch slot (the last rows' slot): the fused KDA decode
        # skips them there (-1: no padding). A graph is captured on an all-padding batch, so it bakes in the
        # scratch slot, which no live request ever holds
        self.pad_slot = batch.host_slots[-1] if decode and batch.padded_rows and batch.host_slots else -1
        self.max_len = 1 if decode else max(cu[b + 1] - cu[b] for b in range(B))
        kv_total = [ctx + cu[b + 1] - cu[b] for b, ctx in enumerate(batch.context_lens)]
        self.num_splits = num_splits_for(max(kv_total), B)
        self.kv_lens = (batch.positions + 1).to(torch.int32)
        self.cu_q = batch.cu_seqlens_dev if batch.cu_seqlens_dev is not None else _upload(cu, dev)
        if batch.req_idx is not None:
            self.req_idx = batch.req_idx
        elif decode:
            self.req_idx = self.cu_q[:B]
        else:
            lens = torch.tensor([cu[b + 1] - cu[b] for b in range(B)])
            self.req_idx = _upload(torch.repeat_interleave(torch.arange(B, dtype=torch.int32), lens), dev)
        # MLA in a step with long segments: those attend in the expanded form over their own context; the short
        # ones (decodes, verifies) keep the absorbed form over their pages (`mla_split`), so a decode row of a
        # mixed step never expands its whole context (64 decodes of 1K context beside a prefill chunk would expand
        # 64K rows: memory the profile does not plan for, and time)
        self.mla_split = None
        if self.max_len > MAX_VERIFY:
            lens = [cu[b + 1] - cu[b] for b in range(B)]
            long = [b for b in range(B) if lens[b] > MAX_VERIFY]
            if len(long) == B:
                self.cu_k = batch.cu_kv_dev if batch.cu_kv_dev is not None else \
                    _upload([0] + list(accumulate(kv_total)), dev)
                self.ctx_rows = MlaGather.row_index_for(batch.block_tables, kv_total, page_size, dev)
            elif batch.cu_seqlens_dev is not None and batch.cu_kv_dev is not None and batch.req_idx is not None:
                # from the runtime's device tensors, no upload: a stable sort puts short rows (segments) first,
                # and the host knows how many there are
                n_short = sum(n for n in lens if n <= MAX_VERIFY)
                cq, ck = batch.cu_seqlens_dev, batch.cu_kv_dev
                seg_len, seg_kv = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
                is_long = seg_len > MAX_VERIFY
                rows = torch.argsort(is_long.index_select(0, self.req_idx.long()).to(torch.int32), stable=True)
                segs = torch.argsort((~is_long).to(torch.int32), stable=True)[:len(long)]
                zero = torch.zeros(1, dtype=torch.int32, device=dev)
                self.mla_split = (rows[:n_short], rows[n_short:])
                self.cu_q_long = torch.cat([zero, seg_len.index_select(0, segs).cumsum(0).to(torch.int32)])
                self.cu_k = torch.cat([zero, seg_kv.index_select(0, segs).cumsum(0).to(torch.int32)])
            else:
                short_rows = [t for b in range(B) if lens[b] <= MAX_VERIFY for t in range(cu[b], cu[b + 1])]
                long_rows = [t for b in long for t in range(cu[b], cu[b + 1])]
                cu_q = [0] + list(accumulate(lens[b] for b in long))
                cu_k = [0] + list(accumulate(kv_total[b] for b in long))
                flat = _upload(short_rows + long_rows + cu_q + cu_k, dev, torch.long)
                n_s, n_l, n_c = len(short_rows), len(long_rows), len(cu_q)
                self.mla_split = (flat[:n_s], flat[n_s:n_s + n_l])
                self.cu_q_long = flat[n_s + n_l:n_s + n_l + n_c].to(torch.int32)
                self.cu_k = flat[n_s + n_l + n_c:].to(torch.int32)
            if self.mla_split is not None:
                self.ctx_rows = MlaGather.row_index_for(
                    batch.block_tables, [kv_total[b] if lens[b] > MAX_VERIFY else 0 for b in range(B)], page_size,
                    dev)
        # speculative verify blocks (StepBatch.verify_segments, in that order): their KDA runs apart from the
        # waves, from the state before the block and leaving it there (`kda_verify`: rows, cumulative block
        # lengths, slots as int32 and int64, 0..B-1 for the copied conv states); the target's commit_verify
        # replays the accepted tokens later
        self.verify_segments = tuple(batch.verify_segments)
        if len(self.verify_segments) == B and batch.cu_seqlens_dev is not None:
            # every segment a verify block (a padded verify step, runtime/inputs.py): the batch's own device
            # tensors, no upload, so the step can be captured in a CUDA graph (rows None: all of them, in order)
            self.kda_verify = (None, batch.cu_seqlens_dev, batch.slots.to(torch.int32), batch.slots,
                               torch.arange(B, dtype=torch.int32, device=dev))
        else:
            self.kda_verify = self._verify(batch, dev) if self.verify_segments else None
        if decode:   # one wave, every segment one token on its own slot (padding rows share the scratch slot)
            self.kda_waves = [(None, self.cu_q, batch.slots.to(torch.int32), [], None)]
        else:
            verify = set(self.verify_segments)
            self.kda_waves = self._waves(batch, [b for b in range(B) if b not in verify], dev)

    def _verify(self, batch, dev):
        cu, slots = batch.cu_seqlens, batch.slot_list
        segs = self.verify_segments
        rows = [t for b in segs for t in range(cu[b], cu[b + 1])]
        vcu = [0] + list(accumulate(cu[b + 1] - cu[b] for b in segs))
        flat = _upload(rows + vcu + [slots[b] for b in segs], dev, torch.long)
        n_r, n_c = len(rows), len(vcu)
        vslots = flat[n_r + n_c:]
        local = torch.arange(len(segs), dtype=torch.int32, device=dev)
        return flat[:n_r], flat[n_r:n_r + n_c].to(torch.int32), vslots.to(torch.int32), vslots, local

    def _waves(self, batch, segs_in: list[int], dev):
        """The KDA waves over the segments `segs_in` (every segment but the verify blocks): (rows or None, cu
        int32, slots int32, snapshot copies, fla_cu). fla_cu, for a chunked (prefill) step, is the wave's
        cumulative lengths as one int64 device tensor and an int64 host tensor, the same objects for every layer:
        fla-core's chunk_kda derives its chunk indices from them, on the host from the host copy (no device
        sync) and once a step (its cache is keyed by the tensors' identity)."""
        cu = batch.cu_seqlens
        slots = batch.slot_list
        snap_of = dict(batch.snapshots)
        if not segs_in:
            return []
        chunked = self.max_len > MAX_VERIFY
        seen: dict[int, int] = {}
        wave_of = {}
        for b in segs_in:
            wave_of[b] = seen.get(slots[b], 0)
            seen[slots[b]] = wave_of[b] + 1
        if max(wave_of.values()) == 0 and len(segs_in) == len(slots):    # one wave: the batch's own layout
            snaps = [(slots[b], snap_of[b]) for b in segs_in if b in snap_of]
            fla_cu = (self.cu_q.long(), torch.tensor(cu, dtype=torch.long)) if chunked else None
            return [(None, self.cu_q, batch.slots.to(torch.int32), snaps, fla_cu)]
        # several waves (or a subset of the segments): every wave's rows, cumulative lengths and slots in one
        # upload and one int32 conversion, each wave's tensors views of them (an 8K prompt cut at its 127 page
        # boundaries is 128 waves: per-wave conversions were 256 launches and 128 host tensors a step, and its rows
        # a per-token list). The rows of all waves, in wave order, are one vectorized host op: row j of a listed
        # segment b is cu[b] + j. The int32 parts start 16-byte aligned (a Triton kernel specializes on its
        # pointers' alignment: a fresh tensor's, as these were, is aligned)
        by_wave: list[list[int]] = [[] for _ in range(max(wave_of.values()) + 1)]
        for b in segs_in:
            by_wave[wave_of[b]].append(b)
        order = [b for segs in by_wave for b in segs]
        lens = [cu[b + 1] - cu[b] for b in order]
        n_rows = sum(lens)
        shift = [cu[b] - first for b, first in zip(order, accumulate(lens, initial=0))]
        base = n_rows + -n_rows % 4
        small, layout, r0 = [], [], 0
        for segs in by_wave:
            small += [0] * (-len(small) % 4)
            o_cu = base + len(small)
            small += accumulate((cu[b + 1] - cu[b] for b in segs), initial=0)
            small += [0] * (-len(small) % 4)
            o_slots = base + len(small)
            small += [slots[b] for b in segs]
            nr = sum(cu[b + 1] - cu[b] for b in segs)
            layout.append((r0, nr, o_cu, o_slots, len(segs), [(slots[b], snap_of[b]) for b in segs if b in snap_of]))
            r0 += nr
        host = torch.zeros(base + len(small), dtype=torch.long)
        torch.arange(n_rows, out=host[:n_rows])
        host[:n_rows] += torch.repeat_interleave(torch.tensor(shift), torch.tensor(lens), output_size=n_rows)
        host[base:] = torch.tensor(small, dtype=torch.long)
        flat = _upload(host, dev)
        flat32 = flat.to(torch.int32)
        waves = []
        for r0, nr, o_cu, o_slots, n, snaps in layout:
            fla_cu = (flat[o_cu:o_cu + n + 1], host[o_cu:o_cu + n + 1]) if chunked else None
            waves.append((flat[r0:r0 + nr], flat32[o_cu:o_cu + n + 1], flat32[o_slots:o_slots + n], snaps, fla_cu))
        return waves


def _upload(values, dev, dtype=torch.int32) -> torch.Tensor:
    """A host list or tensor on the device without waiting for it (only when the runtime did not provide it)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.to(dev, non_blocking=True)
