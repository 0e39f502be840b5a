"""Decode CUDA graphs: the model step runner.

`ModelRunner(batch) -> logits` is the one place the engine runs the model. A pure-decode step (one token per
request, no snapshot) arrives padded to a batch-size bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, then every 32 up to
max_num_seqs) by `StepInputs`, on its static decode buffers: the padding rows carry token 0 at position 0 on the
cache's scratch state slot and scratch page, so they never touch a request's state (their writes race with each
other there; every value stays finite and only padding rows read it). Such a step replays the CUDA graph captured
for (bucket, decode variant); the variant is what the model decides on the host for a decode step (the MLA decode's
split count). Everything else, and every step with `enforce_eager` or a model that does not declare itself
`capturable` (the reference implementation), runs eagerly; on the CPU the padded decode step runs eagerly too, so
the padding path is what CPU tests exercise.

Capture (`capture()`, CUDA only): first a few eager prefill and mixed steps on the scratch slot (`WARMUP_STEPS`:
compiling the Triton variants of the non-graph steps), then buckets from the largest down, all sharing one memory pool
(`torch.cuda.graph_pool_handle`); each is first run eagerly on its own padding inputs, which compiles every
Triton specialization that bucket launches, so no JIT happens on the serving path. A graph copies its logits into
one persistent buffer `[max bucket, vocab]` fp32, so the graphs' own outputs need not stay alive in the pool.
The capture time and the graphs' memory are logged, and progress as it goes.
"""

from __future__ import annotations

import logging
import time

import torch

from kestrel.models.kimi.step import StepBatch

log = logging.getLogger("kestrel.graphs")

SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# Eager steps run before capture, as (context, new tokens) per segment, all on the scratch slot and page: short and
# chunked prefills (lengths divisible by 16 or not), decode rows beside a prefill chunk (the mixed steps continuous
# batching makes while later prompts prefill), and several prompts in one chunk; `warm_up` adds the chunk budget
# split over 8 prompts, and filled with 1K prompts beside 16 or 33 decode rows. Triton specializes integer arguments on divisibility by 16 and on 1, and the host picks
# kernel configs from row counts, so each of these compiles variants the serving path would otherwise compile on
# its first such step (the first batch-64 run after start-up was 1.7x slower than the steady one on the H200).
WARMUP_STEPS = (
    ((0, 3),), ((0, 17),), ((0, 32),), ((0, 100),), ((100, 37),),
    ((37, 1),) + ((0, 100),),
    ((37, 1),) * 16 + ((0, 17),),
    ((37, 1),) * 15 + ((512, 512),),
    ((37, 1),) * 33 + ((0, 1000),),
    ((0, 64),) * 3,
)
BUCKET_STEP = 32


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step is padded to: SMALL_BUCKETS, then every BUCKET_STEP, ending at max_num_seqs."""
    out = [b for b in SMALL_BUCKETS if b < max_num_seqs]
    b = SMALL_BUCKETS[-1] + BUCKET_STEP
    while b < max_num_seqs:
        out.append(b)
        b += BUCKET_STEP
    return out + [max_num_seqs]


class ModelRunner:
    """Runs the model on a StepBatch; pure-decode steps padded to a bucket, replayed from a CUDA graph where one
    was captured. `timed = True` brackets each call with CUDA events (the benchmarks' phase timers): the device time
    of the last call is `take_model_time()` once the step's sampled ids reached the host, so timing adds no sync and
    the host still runs ahead of the device as in serving."""

    def __init__(self, model, cache, inputs, max_num_seqs: int, enforce_eager: bool = False):
        self.model, self.cache, self.inputs = model, cache, inputs
        self.device = cache.device
        self.buckets = decode_buckets(max(1, min(max_num_seqs, cache.num_slots)))
        self.padding = not enforce_eager
        self.capturable = self.padding and self.device.type == "cuda" and getattr(model, "capturable", False)
        self.graphs: dict[tuple[int, object], torch.cuda.CUDAGraph] = {}
        # a drafter's captured hidden states (the model's `captured_hidden`) as each graph wrote them: a replay
        # refills those tensors, so the model is pointed back at them (the last capture's would be another bucket's)
        self.graph_hidden: dict[tuple[int, object], dict] = {}
        self.logits: torch.Tensor | None = None      # the graphs' shared output buffer
        self.graph_bytes = 0
        self.capture_s = 0.0
        self.timed = False
        self._events = None           # (start, end) CUDA events of the last timed call
        self._pending = False         # they hold a call take_model_time has not read yet
        self.replays = 0
        if self.padding:
            inputs.decode_padding(self.bucket_for, self.buckets[-1], cache.scratch_slot, cache.scratch_row)

    def bucket_for(self, num_reqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_reqs:
                return b
        return None

    def is_decode_bucket(self, batch) -> bool:
        """Whether `batch` is one of the static decode-bucket batches (views of the decode buffers)."""
        return self.padding and batch.token_ids.data_ptr() == self.inputs.dec.data_ptr() \
            and batch.token_ids.shape[0] in self.buckets

    def __call__(self, batch) -> torch.Tensor:
        n = batch.token_ids.shape[0]
        timed = self.timed and self.device.type == "cuda"
        if timed:
            if self._events is None:
                self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        graph = None
        if self.graphs and self.is_decode_bucket(batch):
            key = (n, self.model.decode_variant(batch.context_lens))
            graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            if self.graph_hidden.get(key):
                self.model.captured_hidden = dict(self.graph_hidden[key])
            out = self.logits[:n]
        else:
            out = self.model(batch, self.cache.pools)
        if timed:
            self._events[1].record()
            self._pending = True
        live = n - batch.padded_rows
        return out[:live] if batch.padded_rows else out

    def take_model_time(self) -> float | None:
        """Seconds the device spent in the last timed call, or None (not timed, or not on CUDA). Call it after the
        step's results were copied to the host (the events are complete by then: no wait)."""
        if not self._pending:
            return None
        self._pending = False
        start, end = self._events
        return start.elapsed_time(end) / 1e3

    def commit_verify(self, accepted: list[int]) -> None:
        """After a step with verify blocks (always eager): the model keeps `accepted[i]` tokens of the i-th block's
        KDA state (kestrel/spec/; the model's `commit_verify`)."""
        self.model.commit_verify(accepted, self.cache.pools)

    # ---- capture -----------------------------------------------------------------------------------------------
    def _free_after_release(self) -> int:
        """Free device memory once the caching allocator has handed back what it holds unused (the warm-up's
        activations), so the difference across the capture is what the graphs keep."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    def warm_up(self, steps=WARMUP_STEPS) -> None:
        """Run each step of `steps` eagerly through the runtime's own input path (StepInputs.fill, so the kernels
        see the index tensors serving gives them) with every segment on the scratch slot, whose block-table row
        names only the scratch page; steps that do not fit the input buffers or a request's pages are skipped. The largest step
        already ran in the memory profile."""
        c, inp = self.cache, self.inputs
        cap = inp.token_capacity
        steps = list(steps) + ([((0, cap // 8),) * 8] if cap >= 8 else [])
        # the chunked prefill of many 1K prompts beside the decodes of the ones already done (what a batch of
        # prompts arriving together gives): decode rows, whole prompts, and one cut at the budget
        for d in (16, 33):
            if cap > d + 1024:
                k, rest = divmod(cap - d, 1024)
                steps.append(((37, 1),) * d + ((0, 1024),) * k + (((0, rest),) if rest else ()))
        table = torch.full((c.scratch_slot + 1, c.max_pages_per_seq), c.scratch_page, dtype=torch.int32,
                           device=self.device)       # row scratch_slot -> the scratch page, whatever the slot is
        for segs in steps:
            T = sum(n for _, n in segs)
            if T > inp.token_capacity or len(segs) > inp.segment_capacity \
                    or max(a + n for a, n in segs) > c.max_pages_per_seq * c.page_size:
                continue
            tokens, positions, cu, ctx = [], [], [0], []
            for start, n in segs:
                tokens += [0] * n
                positions += range(start, start + n)
                cu.append(cu[-1] + n)
                ctx.append(start)
            batch = inp.fill(tokens, positions, cu, ctx, [c.scratch_slot] * len(segs),
                             [e - 1 for e in cu[1:]], table, [])
            self.model(batch, c.pools)

    def capture(self, max_kv_len: int, progress=None) -> None:
        """Warm up and capture every (bucket, variant) the model can be asked for up to `max_kv_len` tokens of
        context. No-op unless graphs are on (CUDA, not enforce_eager, a capturable model)."""
        if not self.capturable:
            return
        variants = self.model.decode_variants(max_kv_len)        # {variant: a context length that selects it}
        keys = [(n, v) for n in sorted(self.buckets, reverse=True) for v in variants]
        t0 = time.perf_counter()
        self.warm_up()
        free0 = self._free_after_release()
        pool = torch.cuda.graph_pool_handle()
        for i, (n, v) in enumerate(keys):
            self.inputs.fill_padding(n)
            batch = self.inputs.decode_batch(n, self.cache.block_tables, 0, [variants[v]] * n)
            out = self.model(batch, self.cache.pools)     # compiles this bucket's Triton kernels, outside capture
            if self.logits is None:
                self.logits = torch.empty(self.buckets[-1], out.shape[-1], dtype=out.dtype, device=self.device)
            del out
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(batch, self.cache.pools)
                self.logits[:n].copy_(out)
            del out                               # its memory goes back to the shared pool for the next capture
            self.graphs[(n, v)] = graph
            self.graph_hidden[(n, v)] = dict(getattr(self.model, "captured_hidden", None) or {})
            if progress is not None:
                progress(i + 1, len(keys), n)
            else:
                log.info("captured decode graph %d/%d (batch %d, variant %s)", i + 1, len(keys), n, v)
        self.capture_s = time.perf_counter() - t0
        self.graph_bytes = max(0, free0 - self._free_after_release())      # the graphs' pool + the logits buffer
        log.info("decode CUDA graphs: %d captured (batch %s; variants %s) in %.1f s, %.0f MiB", len(keys),
                 ",".join(map(str, self.buckets)), ",".join(map(str, variants)), self.capture_s,
                 self.graph_bytes / 2 ** 20)
