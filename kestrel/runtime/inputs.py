"""Persistent step inputs: the device tensors a model step reads, allocated once and written in place.

A step's host lists (token ids, positions, state slots, logits rows, and the int32 index tensors the targets'
kernels share: request of each token, cumulative segment and kv lengths) go through pinned host staging in one
copy per dtype into slices of these buffers, and the block-table rows of the step's requests are gathered on the
device from the cache's table (one `index_select`); the `StepBatch` fields are views of the buffers. Building a
step never waits for the device, except for a staging buffer's previous copy (issued two steps earlier) to be done.

Pure-decode steps (one token per segment, no snapshot) have buffers of their own, sized for the largest CUDA-graph
bucket, once `decode_padding` has been called (runtime/graphs.py does): the step is padded up to its bucket with
rows on the cache's scratch slot and scratch page, written with ONE host-to-device copy of a `[4, D]` block
(tokens, positions, slots, block-table rows) plus the block-table gather, and the constant index tensors
(request of each token, cu_seqlens, logits rows: all `arange`) are never rewritten. So a decode step of bucket n
always reads the same memory, which is what the graph captured for n replays over.

Speculative verify steps (every segment a verify block of the same R = K + 1 tokens, nothing else in the step) get
the same treatment once `verify_padding(R)` has been called: buffers sized for the largest bucket's n * R tokens,
one `[4, D * R]` copy (tokens, positions, then slots and block-table rows in the first D columns), the block-table
gather, and constant index tensors (request of each token = t // R, cu_seqlens = R * arange, every row a logits
row). Padding blocks are R tokens at positions 0 .. K on the scratch slot and page: the target's verify leaves the
KDA slot untouched and commit_verify is given 0 accepted tokens for them.

A step larger than the general buffers (a prefill under a very large token budget) gets one-off tensors instead.
"""

from __future__ import annotations

from array import array
from typing import Callable

import torch

from kestrel.models.kimi.step import StepBatch

DEFAULT_TOKEN_CAPACITY = 16384


def host_tensor(values, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A CPU tensor of Python ints through an `array` (one C conversion): `torch.tensor(list)` converts element by
    element, 0.9 ms against 0.3 for the 16K ints of an 8K-token prefill's tokens and positions. An `array` of the
    dtype's own typecode is not converted at all: the tensor reads its memory (do not resize it while in use)."""
    code = "q" if dtype == torch.long else "i"
    if not len(values):
        return torch.empty(0, dtype=dtype)
    if not (isinstance(values, array) and values.typecode == code):
        values = array(code, values)
    return torch.frombuffer(values, dtype=dtype)


def segment_positions(cu: list[int], ctx: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """Every token's position when each segment b is a run from its first position ctx[b] on (what the engine's
    steps are): token t of segment b is at ctx[b] + t - cu[b]. An arange plus one offset per segment, written into
    `out` (a host tensor of cu[-1] int64) if given, instead of a Python list of every position."""
    T, B = cu[-1], len(ctx)
    out = torch.arange(T, dtype=torch.long) if out is None else torch.arange(T, out=out)
    if B == 1:
        if ctx[0]:
            out += ctx[0]
    elif B:
        out += torch.repeat_interleave(host_tensor([c - s for c, s in zip(ctx, cu)]),
                                       host_tensor([cu[b + 1] - cu[b] for b in range(B)]), output_size=T)
    return out


def list_positions(cu: list[int], ctx: list[int]) -> list[int]:
    """`segment_positions` as a list (small steps: a decode or verify step's few rows)."""
    return [c + j for b, c in enumerate(ctx) for j in range(cu[b + 1] - cu[b])]


class PinnedStaging:
    """Host memory for host-to-device copies. On a GPU: pinned buffers used in turn, each rewritten only after the
    copies that last read it are done (a CUDA event, usually long past), so the host can run one step ahead of the
    device without corrupting a copy in flight. On the CPU: plain tensors (the copies are synchronous)."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.long, numel: int = 1024, count: int = 2):
        self.device, self.dtype = torch.device(device), dtype
        self.cuda = self.device.type == "cuda"
        self._bufs = [self._alloc(numel) for _ in range(count)] if self.cuda else []
        self._events: list = [None] * count
        self._i = 0

    def _alloc(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, pin_memory=self.cuda)

    def take(self, numel: int) -> torch.Tensor:
        """A host tensor of `numel` to fill and copy from; call `done()` after issuing the copies."""
        if not self.cuda:
            return torch.empty(numel, dtype=self.dtype)
        i = self._i
        if self._events[i] is not None:
            self._events[i].synchronize()
        if self._bufs[i].numel() < numel:
            self._bufs[i] = self._alloc(max(numel, 2 * self._bufs[i].numel()))
        return self._bufs[i][:numel]

    def done(self) -> None:
        if self.cuda:
            ev = self._events[self._i] or torch.cuda.Event()
            ev.record()
            self._events[self._i] = ev
            self._i = (self._i + 1) % len(self._bufs)


class StepInputs:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, page_size: int, max_pages_per_seq: int,
                 device: torch.device, logits_rows_per_seq: int = 1):
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
        # one logits row per segment, or K + 1 per request when speculation verifies blocks
        self.logits_capacity = max(S, min(T, max_num_seqs * logits_rows_per_seq))
        self.logits_indices = torch.zeros(self.logits_capacity, dtype=torch.long, device=dev)
        self.req_idx = torch.zeros(T, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.zeros(S + 1, dtype=torch.int32, device=dev)
        self.cu_kv = torch.zeros(S + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((S, max_pages_per_seq), -1, dtype=torch.int32, device=dev)
        self._stage64 = PinnedStaging(dev, torch.long, 2 * T + S + self.logits_capacity)
        self._stage32 = PinnedStaging(dev, torch.int32, T + 2 * S + 2)
        # decode padding (set by `decode_padding`)
        self.bucket_for: Callable[[int], int | None] | None = None
        self.decode_capacity = 0
        self.verify_len = 0           # R = K + 1 of the padded verify buffers (set by `verify_padding`); 0: none
        self.verify_capacity = 0

    # ---- decode buffers --------------------------------------------------------------------------------------
    def decode_padding(self, bucket_for: Callable[[int], int | None], capacity: int, scratch_slot: int,
                       scratch_row: int) -> None:
        """Pad pure-decode steps of up to `capacity` requests to `bucket_for(B)` rows; padding rows run on the
        cache's scratch state slot and its scratch block-table row (which names only the scratch page)."""
        D, dev = capacity, self.device
        self.bucket_for, self.decode_capacity = bucket_for, D
        self.scratch_slot, self.scratch_row = scratch_slot, scratch_row
        self.dec = torch.zeros(4, D, dtype=torch.long, device=dev)           # tokens, positions, slots, table rows
        self.dec_tables = torch.full((D, self.max_pages_per_seq), -1, dtype=torch.int32, device=dev)
        self.arange32 = torch.arange(D + 1, dtype=torch.int32, device=dev)
        self.arange64 = torch.arange(D, dtype=torch.long, device=dev)
        self._stage_dec = PinnedStaging(dev, torch.long, 4 * D)

    def verify_padding(self, block_len: int, capacity: int) -> None:
        """Pad verify steps of up to `capacity` blocks (a decode bucket), each a verify block of `block_len`
        (= K + 1) tokens, to the decode buckets (call after `decode_padding`)."""
        D, R, dev = capacity, block_len, self.device
        self.verify_len, self.verify_capacity = R, D
        self.ver = torch.zeros(4, D * R, dtype=torch.long, device=dev)    # tokens, positions | slots, table rows
        self.ver_tables = torch.full((D, self.max_pages_per_seq), -1, dtype=torch.int32, device=dev)
        self.ver_req_idx = torch.div(torch.arange(D * R, device=dev), R, rounding_mode="floor").to(torch.int32)
        self.ver_cu = (torch.arange(D + 1, device=dev) * R).to(torch.int32)
        self.ver_rows = torch.arange(D * R, dtype=torch.long, device=dev)
        self._stage_ver = PinnedStaging(dev, torch.long, 4 * D * R)

    def verify_batch(self, n: int, block_tables: torch.Tensor | None = None, live: int = 0,
                     context_lens: list[int] | None = None, host_slots: list[int] | None = None) -> StepBatch:
        """The static StepBatch of verify bucket `n` (n blocks of R tokens): views of the verify buffers; every
        segment is a verify block, the last n - live of them padding."""
        v, R = self.ver, self.verify_len
        if block_tables is not None:
            torch.index_select(block_tables, 0, v[3, :n], out=self.ver_tables[:n])
        ctx = context_lens if context_lens is not None else [0] * n
        return StepBatch(token_ids=v[0, :n * R], positions=v[1, :n * R], cu_seqlens=list(range(0, n * R + 1, R)),
                         context_lens=ctx, slots=v[2, :n], block_tables=self.ver_tables[:n],
                         logits_indices=self.ver_rows[:n * R], snapshots=[],
                         host_slots=host_slots if host_slots is not None else [self.scratch_slot] * n,
                         req_idx=self.ver_req_idx[:n * R], cu_seqlens_dev=self.ver_cu[:n + 1], padded_rows=n - live,
                         verify_segments=tuple(range(n)))

    def fill_verify_padding(self, n: int) -> None:
        """Every block of verify bucket `n` a padding block (the warm-up and capture inputs)."""
        self._write_verify([], [], [], n)

    def _write_verify(self, tokens: list[int], positions: list[int], slots: list[int], n: int) -> list[int]:
        B, R, D = len(slots), self.verify_len, self.verify_capacity
        pad = n - B
        slots = slots + [self.scratch_slot] * pad
        rows = slots[:B] + [self.scratch_row] * pad
        host = self._stage_ver.take(4 * D * R).view(4, D * R)
        host[:, n * R:] = 0
        host[0, :n * R] = torch.tensor(tokens + [0] * (pad * R), dtype=torch.long)
        host[1, :n * R] = torch.tensor(positions + list(range(R)) * pad, dtype=torch.long)
        host[2, :n] = torch.tensor(slots, dtype=torch.long)
        host[3, :n] = torch.tensor(rows, dtype=torch.long)
        self.ver.copy_(host, non_blocking=True)
        self._stage_ver.done()
        return slots

    def decode_batch(self, n: int, block_tables: torch.Tensor | None = None, live: int = 0,
                     context_lens: list[int] | None = None, host_slots: list[int] | None = None) -> StepBatch:
        """The static StepBatch of decode bucket `n`: views of the decode buffers (what a graph for n reads).
        With `block_tables`, first gather the rows named in the buffers' row column from it."""
        d = self.dec
        if block_tables is not None:
            torch.index_select(block_tables, 0, d[3, :n], out=self.dec_tables[:n])
        ctx = context_lens if context_lens is not None else [0] * n
        return StepBatch(token_ids=d[0, :n], positions=d[1, :n], cu_seqlens=list(range(n + 1)), context_lens=ctx,
                         slots=d[2, :n], block_tables=self.dec_tables[:n], logits_indices=self.arange64[:n],
                         snapshots=[], host_slots=host_slots if host_slots is not None else [self.scratch_slot] * n,
                         req_idx=self.arange32[:n], cu_seqlens_dev=self.arange32[:n + 1], padded_rows=n - live)

    def fill_padding(self, n: int) -> None:
        """Every row of decode bucket `n` a padding row (the warm-up and capture inputs)."""
        self._write_decode([], [], [], n)

    def _write_decode(self, tokens: list[int], positions: list[int], slots: list[int], n: int) -> list[int]:
        B, D = len(tokens), self.decode_capacity
        pad = n - B
        slots = slots + [self.scratch_slot] * pad
        rows = slots[:B] + [self.scratch_row] * pad
        host = self._stage_dec.take(4 * D).view(4, D)
        host[:, n:] = 0
        # one host tensor for the four rows: each torch call costs microseconds on the decode step's host path
        host[:, :n] = torch.tensor([tokens + [0] * pad, positions + [0] * pad, slots, rows], dtype=torch.long)
        self.dec.copy_(host, non_blocking=True)
        self._stage_dec.done()
        return slots

    # ---- a step ------------------------------------------------------------------------------------------------
    def fill(self, tokens, positions: list[int] | None, cu: list[int], ctx: list[int], slots: list[int],
             logits_rows: list[int], block_tables: torch.Tensor,
             snapshots: list[tuple[int, int]], verify_segments: tuple[int, ...] = ()) -> StepBatch:
        """Write one step's inputs into the buffers and return the StepBatch of views over them.
        `tokens`: a list of ints or an int64 `array` (the engine's: prompt chunks are C slices of the prompt's);
        `positions`: None when each segment b runs on from its first position ctx[b] (`segment_positions`: the
        engine's steps, computed here without a per-token list);
        `block_tables` is the cache's device table [num_slots + 1, max_pages], indexed by `slots`;
        `verify_segments` the segments that are speculative verify blocks (StepBatch.verify_segments)."""
        T, B, N = len(tokens), len(slots), len(logits_rows)
        R = self.verify_len
        if R and self.bucket_for is not None and len(verify_segments) == B and T == B * R and N == T \
                and logits_rows == list(range(T)) and not snapshots and B <= self.verify_capacity and cu == list(range(0, T + 1, R)):
            n = self.bucket_for(B)
            if n is not None:
                host_slots = self._write_verify(list(tokens), positions if positions is not None else
                                                list_positions(cu, ctx), slots, n)
                return self.verify_batch(n, block_tables, B, ctx + [0] * (n - B), host_slots)
        if self.bucket_for is not None and T == B and not snapshots and B <= self.decode_capacity \
                and logits_rows == list(range(B)):
            n = self.bucket_for(B)
            if n is not None:      # one token a segment: each at its first position
                host_slots = self._write_decode(list(tokens), positions if positions is not None else ctx, slots, n)
                return self.decode_batch(n, block_tables, B, ctx + [0] * (n - B), host_slots)
        cu_kv = [0] * (B + 1)
        for b in range(B):
            cu_kv[b + 1] = cu_kv[b] + ctx[b] + cu[b + 1] - cu[b]
        if T > self.token_capacity or B > self.segment_capacity or N > self.logits_capacity:
            return self._one_off(tokens, positions, cu, ctx, slots, logits_rows, cu_kv, block_tables,
                                 snapshots, verify_segments)
        # straight into the staging buffers: the tokens' buffer copied, the positions and request indices written
        # by vectorized host ops (no per-token Python list, no intermediate tensor)
        h64 = self._stage64.take(2 * T + B + N)
        h64[:T] = host_tensor(tokens)
        if positions is None:
            segment_positions(cu, ctx, h64[T:2 * T])
        else:
            h64[T:2 * T] = host_tensor(positions)
        h64[2 * T:] = host_tensor(slots + logits_rows)
        h32 = self._stage32.take(T + 2 * B + 2)
        _request_index(cu, h32[:T])
        h32[T:].copy_(host_tensor(cu + cu_kv, torch.int32))
        o = 0
        for buf, n in ((self.token_ids, T), (self.positions, T), (self.slots, B), (self.logits_indices, N)):
            buf[:n].copy_(h64[o:o + n], non_blocking=True)
            o += n
        self.req_idx[:T].copy_(h32[:T], non_blocking=True)
        self.cu_seqlens[:B + 1].copy_(h32[T:T + B + 1], non_blocking=True)
        self.cu_kv[:B + 1].copy_(h32[T + B + 1:], non_blocking=True)
        self._stage64.done()
        self._stage32.done()
        slot_v = self.slots[:B]
        bt = self.block_tables[:B]
        torch.index_select(block_tables, 0, slot_v, out=bt)
        return StepBatch(token_ids=self.token_ids[:T], positions=self.positions[:T], cu_seqlens=cu,
                         context_lens=ctx, slots=slot_v, block_tables=bt, logits_indices=self.logits_indices[:N],
                         snapshots=snapshots, host_slots=slots, req_idx=self.req_idx[:T],
                         cu_seqlens_dev=self.cu_seqlens[:B + 1], cu_kv_dev=self.cu_kv[:B + 1],
                         verify_segments=tuple(verify_segments))

    def _one_off(self, tokens, positions, cu, ctx, slots, logits_rows, cu_kv, block_tables,
                 snapshots, verify_segments=()) -> StepBatch:
        self.oversize_steps += 1
        T, B = len(tokens), len(slots)
        pos = segment_positions(cu, ctx) if positions is None else host_tensor(positions)
        dev = torch.cat([host_tensor(tokens), pos, host_tensor(slots + logits_rows)]).to(self.device,
                                                                                        non_blocking=True)
        i32 = torch.cat([_request_index(cu, torch.empty(T, dtype=torch.int32)),
                         host_tensor(cu + cu_kv, torch.int32)]).to(self.device, non_blocking=True)
        slot_v = dev[2 * T:2 * T + B]
        return StepBatch(token_ids=dev[:T], positions=dev[T:2 * T], cu_seqlens=cu, context_lens=ctx, slots=slot_v,
                         block_tables=block_tables.index_select(0, slot_v), logits_indices=dev[2 * T + B:],
                         snapshots=snapshots, host_slots=slots, req_idx=i32[:T], cu_seqlens_dev=i32[T:T + B + 1],
                         cu_kv_dev=i32[T + B + 1:], verify_segments=tuple(verify_segments))


def _request_index(cu: list[int], out: torch.Tensor) -> torch.Tensor:
    """The int32 segment of each token into `out` [cu[-1]]: a fill for a one-segment step (an 8K prefill), else a
    repeat of 0..B-1 by the segments' lengths."""
    B = len(cu) - 1
    if B == 1:
        return out.zero_()
    out.copy_(torch.repeat_interleave(torch.arange(B, dtype=torch.int32),
                                      host_tensor([cu[b + 1] - cu[b] for b in range(B)]), output_size=cu[-1]))
    return out
