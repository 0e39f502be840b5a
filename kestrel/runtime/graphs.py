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

Speculative verify steps (`verify_len` = K + 1 given: speculation is configured and the model verifies) are graphs
too: a step whose every segment is a verify block of K + 1 tokens (no prefill, no plain decode beside them) is
padded by `StepInputs` to a bucket with blocks on the scratch slot and page, and replays the graph captured for
(bucket, K, variant) (the variant of the block's last position). Verify buckets stop at the largest batch a verify
step can have (`max_num_seqs`, the token budget over K + 1, `disable_by_batch_size`), and at 64 blocks
(`VERIFY_GRAPH_MAX_BATCH`: larger verify steps run eagerly). A replay runs no Python,
so what the forward leaves on the model for later (the KDA replay buffers `commit_verify` reads: views of buffers
every verify graph shares; a drafter's captured hidden states: tensors of the pool) is kept per graph at capture and
the model pointed back at it after each replay (`graph_state` / `set_graph_state`); when the model's
`capture_layers` changed since the capture, steps run eagerly. `commit_verify` stays eager (it runs after acceptance,
whose count it needs) and gives the padding blocks 0 accepted tokens. Verify graphs share the pool and the measured
graph memory with the decode graphs; their logits go to a buffer of their own, `[max verify bucket * (K + 1), vocab]`.

A proposer with a device-side propose (DSpark over its pages) is padded to the verify buckets too (`proposer.pad_to`:
static inputs filled per propose, padding rows on the scratch block-table row), and one graph per bucket is
captured after the step graphs, in the same pool and the same measured memory (`_capture_proposes`); the proposer
replays it (`proposer.graphs`, `proposer.replays`). Its `observe` (the context write after every step) is
fixed-shape on the static batches, so when the proposer says it may be (`observe_capturable`) every step graph runs
it after the forward (`observe_in_graphs`) and `observed` tells the engine the replay already did it.
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from kestrel.models.kimi.step import StepBatch

log = logging.getLogger("kestrel.graphs")

SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# Eager steps run before capture, as (context, new tokens) per segment, on free slots and the scratch page: short and
# chunked prefills (lengths divisible by 16 or not), decode rows beside a prefill chunk (the mixed steps continuous
# batching makes while later prompts prefill), and several prompts in one chunk; `warm_up` adds the chunk budget
# split over 8 prompts, and filled with 1K prompts beside 16 or 33 decode rows. Triton specializes integer arguments
# on divisibility by 16 and on 1, and the host picks kernel configs from row counts, so each of these compiles
# variants the serving path would otherwise compile on its first such step (the first batch-64 run after start-up
# was 1.7x slower than the steady one on the H200). The prefill kernels leave the segment count unspecialized and
# size their per-segment block as a power of two >= 16: `warm_up` adds one step per block size from 32.
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


# verify steps of more blocks than this run eagerly: there the step is bound by its K + 1 rows a request, not by
# launches, the policy mostly turns speculation off, and the verify logits buffer ([bucket * (K + 1), vocab] fp32:
# 336 MB at 64 x 8 rows of K3's 163,840) would grow with max_num_seqs
VERIFY_GRAPH_MAX_BATCH = 64


def max_verify_blocks(spec, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most verify blocks a padded (graph) verify step holds under a SpeculativeConfig: max_num_seqs, the token
    budget over K + 1, `disable_by_batch_size` (unless `enforce`) and VERIFY_GRAPH_MAX_BATCH."""
    n = min(max_num_seqs, VERIFY_GRAPH_MAX_BATCH,
            max(1, max_num_batched_tokens // (1 + spec.num_speculative_tokens)))
    if spec.disable_by_batch_size is not None and not spec.enforce:
        n = min(n, max(1, spec.disable_by_batch_size))
    return n


class ModelRunner:
    """Runs the model on a StepBatch; pure-decode and all-verify steps padded to a bucket, replayed from a CUDA graph
    where one was captured. `timed = True` brackets each call with CUDA events (the benchmarks' phase timers): the
    device time of a call is `take_model_time()` (oldest call first) once its step's sampled ids reached the host,
    so timing adds no sync and the host still runs ahead of the device as in serving.
    `verify_len`: K + 1 when speculation verifies blocks of K drafts (0: none); `max_verify_batch`: the most blocks
    a verify step can hold (the verify buckets end at the bucket of that)."""

    def __init__(self, model, cache, inputs, max_num_seqs: int, enforce_eager: bool = False, verify_len: int = 0,
                 max_verify_batch: int | None = None, proposer=None):
        self.model, self.cache, self.inputs = model, cache, inputs
        self.device = cache.device
        self.max_reqs = max(1, min(max_num_seqs, cache.num_slots))       # the requests a step can hold
        self.buckets = decode_buckets(self.max_reqs)
        self.padding = not enforce_eager
        self.capturable = self.padding and self.device.type == "cuda" and getattr(model, "capturable", False)
        self.graphs: dict[tuple[int, object], torch.cuda.CUDAGraph] = {}
        self.verify_graphs: dict[tuple[int, int, object], torch.cuda.CUDAGraph] = {}
        # what each graph's capture left on the model (captured hidden states, verify replay buffers: tensors of the
        # pool a replay rewrites), restored after its replay (`graph_state`)
        self.graph_state: dict[tuple, dict] = {}
        self.logits: torch.Tensor | None = None          # the decode graphs' shared output buffer
        self.verify_logits: torch.Tensor | None = None   # the verify graphs'
        self.graph_bytes = 0
        self.capture_s = 0.0
        self.timed = False
        # (start, end) CUDA events of timed calls take_model_time has not read yet, oldest first (with async
        # scheduling a step is launched before the previous one's time is read), and pairs free for reuse
        self._timed_calls: collections.deque = collections.deque()
        self._free_events: list = []
        self.replays = 0              # graph replays, decode and verify
        # whether the last call replayed a graph that also ran the proposer's observe (`observe_in_graphs`)
        self.observed = False
        self.observe_in_graphs = False
        self.verify_replays = 0
        self._pad_blocks = 0          # padding blocks of the last verify step (commit_verify gives them 0)
        self.captured_layers: tuple[int, ...] = ()   # the model's capture_layers when the graphs were captured
        self.verify_len = verify_len if getattr(model, "supports_verify", False) else 0
        self.verify_buckets: list[int] = []
        if self.padding:
            inputs.decode_padding(self.bucket_for, self.buckets[-1], cache.scratch_slot, cache.scratch_row)
            if self.verify_len:
                cap = min(self.buckets[-1], max_verify_batch or self.buckets[-1])
                top = self.bucket_for(max(1, cap))
                self.verify_buckets = [b for b in self.buckets if b <= top]
                inputs.verify_padding(self.verify_len, top)
                if proposer is not None:      # its proposes padded to the verify buckets too (a drafter's graphs)
                    proposer.pad_to(self.verify_buckets, cache.block_tables, cache.scratch_row)
        self.proposer = proposer

    def bucket_for(self, num_reqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_reqs:
                return b
        return None

    def is_decode_bucket(self, batch) -> bool:
        """Whether `batch` is one of the static decode-bucket batches (views of the decode buffers)."""
        return self.padding and batch.token_ids.data_ptr() == self.inputs.dec.data_ptr() \
            and batch.token_ids.shape[0] in self.buckets

    def is_verify_bucket(self, batch) -> bool:
        """Whether `batch` is one of the static verify-bucket batches (views of the verify buffers)."""
        return bool(self.verify_buckets) and batch.token_ids.data_ptr() == self.inputs.ver.data_ptr() \
            and batch.num_reqs in self.verify_buckets

    def verify_variant(self, context_lens: list[int]) -> object:
        """A verify step's variant: the decode variant of its blocks' last positions."""
        k = self.verify_len - 1
        return self.model.decode_variant([c + k for c in context_lens])

    def _graph_for(self, batch):
        if tuple(getattr(self.model, "capture_layers", ())) != self.captured_layers:
            # the graphs compute the hidden states of the layers a drafter asked for at capture; asked for others
            # since, a replay would hand the drafter the wrong ones: run eagerly
            return None, None, None
        if self.graphs and self.is_decode_bucket(batch):
            key = (batch.num_reqs, self.model.decode_variant(batch.context_lens))
            return key, self.graphs.get(key), self.logits
        if self.verify_graphs and self.is_verify_bucket(batch):
            key = (batch.num_reqs, self.verify_len - 1, self.verify_variant(batch.context_lens))
            return key, self.verify_graphs.get(key), self.verify_logits
        return None, None, None

    def __call__(self, batch) -> torch.Tensor:
        n = batch.token_ids.shape[0]
        timed = self.timed and self.device.type == "cuda"
        if timed:
            events = self._free_events.pop() if self._free_events else \
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        key, graph, logits = self._graph_for(batch)
        self.observed = graph is not None and self.observe_in_graphs
        if graph is not None:
            graph.replay()
            self.replays += 1
            if len(key) == 3:
                self.verify_replays += 1
            if self.graph_state.get(key):
                self.model.set_graph_state(self.graph_state[key])
            out = logits[:n]
        else:
            out = self.model(batch, self.cache.pools)
        self._pad_blocks = batch.padded_rows if batch.verify_segments else 0
        if timed:
            events[1].record()
            self._timed_calls.append(events)
        if not batch.padded_rows:
            return out
        per = out.shape[0] // batch.num_reqs          # logits rows per segment: 1 (decode) or K + 1 (verify)
        return out[:out.shape[0] - batch.padded_rows * per]

    def take_model_time(self) -> float | None:
        """Seconds the device spent in the oldest timed call not read yet, or None (not timed, or not on CUDA).
        Call it after that step's results were copied to the host (the events are complete by then: no wait)."""
        if not self._timed_calls:
            return None
        start, end = events = self._timed_calls.popleft()
        self._free_events.append(events)
        return start.elapsed_time(end) / 1e3

    def commit_verify(self, accepted: list[int]) -> None:
        """After a step with verify blocks (eager: it needs the acceptance): the model keeps `accepted[i]` tokens of
        the i-th live block's KDA state (kestrel/spec/; the model's `commit_verify`); padding blocks keep none."""
        self.model.commit_verify(list(accepted) + [0] * self._pad_blocks, self.cache.pools)
        self._pad_blocks = 0

    # ---- capture -----------------------------------------------------------------------------------------------
    def _free_after_release(self) -> int:
        """Free device memory once the caching allocator has handed back what it holds unused (the warm-up's
        activations), so the difference across the capture is what the graphs keep."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    def warm_up(self, steps=WARMUP_STEPS) -> None:
        """Run each step of `steps` eagerly through the runtime's own input path (StepInputs.fill, so the kernels
        see the index tensors serving gives them) with each segment on a free slot (zeroed afterwards) and every
        block-table row naming only the scratch page; steps that do not fit the input buffers or a request's pages
        are skipped. The largest step already ran in the memory profile."""
        c, inp = self.cache, self.inputs
        cap = inp.token_capacity
        # the most segments a serving step can have: a request brings more than one only when its prompt chunk is
        # cut for prefix-cache snapshots; steps beyond it would compile nothing serving launches, and with fewer
        # free slots than segments they run one KDA wave per segment (at max_num_seqs 1, most of a 27-layer
        # start-up went to those waves' launches)
        most = inp.segment_capacity if c.prefix_caching and c.num_snapshots else self.max_reqs
        steps = list(steps) + ([((0, cap // 8),) * 8] if cap >= 8 else [])
        # the chunked prefill of many 1K prompts beside the decodes of the ones already done (what a batch of
        # prompts arriving together gives): decode rows, whole prompts, and one cut at the budget
        for d in (16, 33):
            if cap > d + 1024:
                k, rest = divmod(cap - d, 1024)
                steps.append(((37, 1),) * d + ((0, 1024),) * k + (((0, rest),) if rest else ()))
        # prefill kernels size a per-segment block by the next power of two of the segment count (at least 16):
        # our KDA chunk kernels over the segments of a wave, MLA prefill over the long ones (more than MAX_VERIFY
        # tokens), so per block size from 32, up to the input buffers' segment capacity: decode rows beside one
        # prompt, and many short prompts with and without a decode row (a burst of short prompts compiled two MLA
        # prefill variants on the serving path without the last two)
        size = 32
        while size // 2 + 2 <= min(most, inp.segment_capacity):
            n = size // 2 + 1
            steps += [((37, 1),) * (size // 2) + ((0, 17),), ((0, 9),) * n, ((37, 1),) + ((0, 9),) * n]
            size *= 2
        table = torch.full((c.scratch_slot + 1, c.max_pages_per_seq), c.scratch_page, dtype=torch.int32,
                           device=self.device)       # every slot's row -> the scratch page
        # each segment on its own free request slot, as in serving: segments sharing a slot would run as one-segment
        # KDA waves (StepPlan) and leave the many-segment variants uncompiled (the short conv's, before it lost its
        # segment block; the KDA chunk kernels' still); acquiring a slot zeroes it again
        free = list(c.free_slots)
        touched: set[int] = set()
        for segs in steps:
            T = sum(n for _, n in segs)
            if T > inp.token_capacity or len(segs) > min(most, inp.segment_capacity) \
                    or max(a + n for a, n in segs) > c.max_pages_per_seq * c.page_size:
                continue
            tokens, positions, cu, ctx = [], [], [0], []
            for start, n in segs:
                tokens += [0] * n
                positions += range(start, start + n)
                cu.append(cu[-1] + n)
                ctx.append(start)
            slots = free[:len(segs)] if len(segs) <= len(free) else [c.scratch_slot] * len(segs)
            touched.update(s for s in slots if s != c.scratch_slot)
            batch = inp.fill(tokens, positions, cu, ctx, slots, [e - 1 for e in cu[1:]], table, [])
            self.model(batch, c.pools)
        c.pools.reset_slots(sorted(touched))

    def _padding_batch(self, key, variants):
        """The all-padding static batch of a decode key (n, variant) or a verify key (n, K, variant)."""
        if len(key) == 2:
            n, v = key
            self.inputs.fill_padding(n)
            return self.inputs.decode_batch(n, self.cache.block_tables, 0, [variants[v]] * n)
        n, k, v = key
        self.inputs.fill_verify_padding(n)
        # the context the variant's decode row claims, less the block: its last position selects the same variant
        return self.inputs.verify_batch(n, self.cache.block_tables, 0, [max(0, variants[v] - k)] * n)

    def _keys(self, max_kv_len: int) -> tuple[list, dict]:
        """The (bucket, variant) decode keys and (bucket, K, variant) verify keys to capture, largest first, and the
        variants {variant: a context length that selects it}."""
        variants = self.model.decode_variants(max_kv_len)
        # a variant a bucket's batch cannot select (one for small batches only) is not captured for it
        pick = self.model.decode_variant
        keys = [(n, v) for n in sorted(self.buckets, reverse=True) for v in variants if pick([variants[v]] * n) == v]
        keys += [(n, self.verify_len - 1, v) for n in sorted(self.verify_buckets, reverse=True) for v in variants
                 if pick([variants[v]] * n) == v]
        return keys, variants

    def _observes(self, layers: tuple[int, ...]) -> bool:
        """Whether the graphs run the proposer's observe too (the drafter's context write after every step is
        fixed-shape on the static batches) when the model keeps the hidden states of `layers`."""
        p = self.proposer
        return bool(p is not None and layers and tuple(p.capture_layers) == layers
                    and getattr(p, "observe_capturable", False))

    def compile_ahead(self, max_kv_len: int) -> None:
        """The eager steps `capture` runs (the warm-up's, each graph's, each propose's), as a dry run of
        runtime/precompile.py inside its `dry_run()`: their Triton variants go to the compile workers at once and
        nothing is launched. Then the scratch slot and page, which the dry steps' torch ops may have written, are
        zeroed again (the warm-up zeroes the free slots it used itself)."""
        if not self.capturable:
            return
        keys, variants = self._keys(max_kv_len)
        p = self.proposer
        self.observe_in_graphs = self._observes(tuple(getattr(self.model, "capture_layers", ())))
        self.warm_up()
        for key in keys:
            self._step_and_observe(self._padding_batch(key, variants))
        for n in sorted(getattr(p, "buckets", None) or (), reverse=True):
            p.fill_padding(n)
            p.run_padded(n, self.cache.pools)
        c = self.cache
        c.pools.reset_slots([c.scratch_slot])
        for pages in c.pools.mla.values():
            pages[c.scratch_page].zero_()

    def capture(self, max_kv_len: int, progress=None) -> None:
        """Warm up and capture every (bucket, variant) the model can be asked for up to `max_kv_len` tokens of
        context, and with speculation every (verify bucket, K, variant). No-op unless graphs are on (CUDA, not
        enforce_eager, a capturable model)."""
        if not self.capturable:
            return
        keys, variants = self._keys(max_kv_len)
        k = self.verify_len - 1
        self.captured_layers = tuple(getattr(self.model, "capture_layers", ()))
        self.observe_in_graphs = self._observes(self.captured_layers)
        t0 = time.perf_counter()
        self.warm_up()
        free0 = self._free_after_release()
        pool = torch.cuda.graph_pool_handle()
        for i, key in enumerate(keys):
            verify = len(key) == 3
            n = key[0]
            batch = self._padding_batch(key, variants)
            rows = batch.token_ids.shape[0]
            out = self._step_and_observe(batch)     # compiles this bucket's Triton kernels, outside capture
            if verify and self.verify_logits is None:
                self.verify_logits = torch.empty(self.verify_buckets[-1] * self.verify_len, out.shape[-1],
                                                 dtype=out.dtype, device=self.device)
            elif not verify and self.logits is None:
                self.logits = torch.empty(self.buckets[-1], out.shape[-1], dtype=out.dtype, device=self.device)
            buf = self.verify_logits if verify else self.logits
            del out
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._step_and_observe(batch)
                buf[:rows].copy_(out)
            del out                               # its memory goes back to the shared pool for the next capture
            (self.verify_graphs if verify else self.graphs)[key] = graph
            state = getattr(self.model, "graph_state", None)
            self.graph_state[key] = state() if state is not None else {}
            if progress is not None:
                progress(i + 1, len(keys), n)
            else:
                log.info("captured %s graph %d/%d (batch %d, %svariant %s)", "verify" if verify else "decode",
                         i + 1, len(keys), n, f"K {k}, " if verify else "", key[-1])
        self._capture_proposes(pool, progress)
        self.capture_s = time.perf_counter() - t0
        self.graph_bytes = max(0, free0 - self._free_after_release())      # the graphs' pool + the logits buffers
        log.info("CUDA graphs: %d decode (batch %s; variants %s)%s captured in %.1f s, %.0f MiB", len(self.graphs),
                 ",".join(map(str, self.buckets)), ",".join(map(str, variants)),
                 f" + {len(self.verify_graphs)} verify (K {k}, batch {','.join(map(str, self.verify_buckets))})"
                 if self.verify_graphs else "", self.capture_s, self.graph_bytes / 2 ** 20)

    def _step_and_observe(self, batch) -> torch.Tensor:
        """The model step a graph holds: the forward, then (`observe_in_graphs`) the proposer's observe of it."""
        out = self.model(batch, self.cache.pools)
        if self.observe_in_graphs:
            self.proposer.observe(batch, self.model.captured_hidden, self.cache.pools)
        return out

    def _capture_proposes(self, pool, progress=None) -> None:
        """One graph per bucket of the proposer's padded propose (a drafter's block forward, LM head, Markov loop and
        draws over its static inputs), in the shared pool, largest first; each run eagerly first (its Triton
        kernels compiled outside capture). Their outputs are the proposer's static buffers."""
        p = self.proposer
        buckets = sorted(getattr(p, "buckets", None) or (), reverse=True)
        p_graphs = getattr(p, "graphs", None)
        if p_graphs is not None:
            p_graphs.clear()
        for i, n in enumerate(buckets):
            p.fill_padding(n)
            p.run_padded(n, self.cache.pools)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                p.run_padded(n, self.cache.pools)
            p.graphs[n] = graph
            if progress is not None:
                progress(i + 1, len(buckets), n)
            else:
                log.info("captured propose graph %d/%d (batch %d, K %d)", i + 1, len(buckets), n, p.num_tokens)
        if buckets:
            log.info("CUDA graphs: %d propose (%s, K %d, batch %s)", len(buckets), p.method, p.num_tokens,
                     ",".join(map(str, sorted(buckets))))
