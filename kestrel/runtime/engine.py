"""The engine: requests in, tokens out, one model step at a time.

`Engine.step()` asks the scheduler what to run, lays it out as one flat `StepBatch` (prompt chunks split at the
page boundaries that need a KDA snapshot) written into the persistent input buffers of `StepInputs` (so a decode
step always reads the same device memory, ready for CUDA-graph capture), runs the model, samples, and applies stop
conditions. `AsyncEngine` drives `step()` from a background task for the server and streams each request's deltas;
`abort` ends a stream with finish_reason "abort" and frees the request's pages and slot at once.

A request's state lives in its `Request` alone (tokens, cache handles, sampler row, text and stop state, output
stream); the engine keeps one dict of them, from `add_request` until `release`.

Speculative decoding (`EngineConfig.speculative_config`, kestrel/spec/): the policy picks, per step, the decoding
requests that speculate; the scheduler gives each a verify block (its last token and K drafts); the proposer fills
the drafts (a DSpark block stays on the device, copied into the verify's input rows there: the host never waits for
the propose); the model scores every row of the block in the same step as the other requests (KDA with replay, the
state untouched); acceptance keeps the longest agreeing prefix plus one token of the target's own; the model's
`commit_verify` advances each KDA state over exactly the accepted tokens; pages past them go back to the pool; and
the accepted tokens go through the stop conditions one by one (one RequestOutput each). A step whose every request
verifies a full block of K drafts replays a verify CUDA graph (runtime/graphs.py), like a pure decode step; a step
mixing verify blocks with plain decodes or prefill chunks, or with shorter blocks, runs eagerly. A DSpark propose
replays a graph per verify bucket of its own, and its observe runs inside the step graphs.

Async scheduling (`EngineConfig.async_scheduling`, vLLM's `--async-scheduling`): a pure-decode step N (every entry
one token of a decoding request, no grammar, no hand-off) is launched and its ids start for the host (pinned memory,
a CUDA event); before the host reads them, step N+1 is planned on the assumption that every running request of N
continues one token (`Scheduler.plan_ahead`: position + 1, a page where it crosses a boundary) and launched, its
input ids gathered on the device from N's sampled ids into the persistent input buffer. Then the host waits for N's
ids and do N's bookkeeping (`_complete`: append, logprobs, stop conditions, outputs), while N+1 runs. So `step()`
returns the outputs of the step before the one it leaves in flight, in order. A request that ended at N (or was
aborted) still has a row in N+1: that row's token is dropped, and its pages and slot go back only once N+1 completed
(`_Launched.release_after`), so no other request gets them while a launched step may write them. Anything else (a
request to admit, a prefill chunk, speculation, a grammar, a page that cannot be had) drains the pipeline: the step
in flight is completed and the next one is scheduled and run synchronously. On the CPU the same order runs (each
"launch" finishes at once), so the lagged bookkeeping is what CPU tests exercise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import operator
import time
from array import array
from dataclasses import dataclass, field

import torch

from kestrel.config import EngineConfig, ModelConfig
from kestrel.errors import RequestError
from kestrel.models.kimi.step import StepBatch
from kestrel.runtime import precompile
from kestrel.runtime.cache import HybridCache
from kestrel.runtime.graphs import ModelRunner, max_verify_blocks
from kestrel.runtime.inputs import StepInputs
from kestrel.runtime.request import Request, RequestOutput, Status, TextState
from kestrel.runtime.sampler import Sampler, unpack_logprobs
from kestrel.runtime.scheduler import Scheduled, Scheduler
from kestrel.sampling_params import SamplingParams
from kestrel.spec.acceptance import Accepted, accept
from kestrel.spec.policy import SpecPolicy
from kestrel.spec.proposer import DraftBlock, DraftInput

log = logging.getLogger("kestrel.engine")


class Engine:
    def __init__(self, config: ModelConfig, engine_config: EngineConfig, model, cache: HybridCache, tokenizer=None,
                 proposer=None):
        self.config, self.engine_config = config, engine_config
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.device = cache.device
        self.max_model_len = engine_config.max_model_len or config.max_position_embeddings
        # [spec] speculative decoding: the proposer, the per-step policy and the counters /metrics shows
        spec = engine_config.speculative_config
        self.proposer = self.policy = self.spec_stats = None
        if spec is not None:
            if not getattr(model, "supports_verify", False):
                from kestrel.errors import ConfigError
                raise ConfigError(f"--speculative-config: the model {type(model).__name__} has no speculative "
                                  "verify step (supports_verify / commit_verify, KDA replay); run the reference "
                                  "implementation (--modeling off) or an sm_90 target, which both verify")
            if proposer is None:
                from kestrel.spec import make_proposer
                proposer = make_proposer(spec, config, cache.device, cache.dtype)
                if hasattr(proposer, "share_target") and hasattr(model, "head_weight"):
                    proposer.share_target(model)       # a drafter reads the target's embedding and LM head
            self.proposer, self.policy, self.spec_stats = proposer, SpecPolicy(spec), SpecStats(spec.num_speculative_tokens)
            if proposer.capture_layers:     # the model keeps these layers' outputs in `captured_hidden` per step
                model.capture_layers = tuple(proposer.capture_layers)
        self.scheduler = Scheduler(cache, engine_config.max_num_seqs, engine_config.max_num_batched_tokens,
                                   self.policy.draft_len if self.policy else None)
        self.inputs = StepInputs(self.scheduler.max_num_seqs, engine_config.max_num_batched_tokens, cache.page_size,
                                 cache.max_pages_per_seq, cache.device,
                                 1 + (spec.num_speculative_tokens if spec else 0))
        self.sampler = Sampler(self.scheduler.max_num_seqs, config.vocab_size, cache.device)
        # grammar-constrained decoding: given the step's sampled requests, an int32 [B, ceil(V/32)] device bitmask
        # (bit 1 = allowed) or None; left None, sampling pays nothing for it
        self.token_bitmask = None
        # --- grammar: requests that carry a grammar (Request.grammar) get their rows filled here each step
        self._num_grammars = 0
        self._host_bitmask: torch.Tensor | None = None
        self._device_bitmask: torch.Tensor | None = None
        # [graphs] the model runs through the runner: pure-decode steps padded to a bucket and replayed from a
        # CUDA graph (runtime/graphs.py); capture happens here, once, on CUDA unless enforce_eager
        verify_len, max_verify = 0, None
        if spec is not None:       # verify steps replay graphs too: blocks of K + 1, at most this many a step
            verify_len = 1 + spec.num_speculative_tokens
            max_verify = max_verify_blocks(spec, self.scheduler.max_num_seqs, engine_config.max_num_batched_tokens)
        self.runner = ModelRunner(model, cache, self.inputs, self.scheduler.max_num_seqs, engine_config.enforce_eager,
                                  verify_len, max_verify, self.proposer)
        # the sampler's Triton kernels compiled (or loaded from Triton's cache) now, not on the first sampled step;
        # first the same start-up as a dry run, whose variants compile in parallel (runtime/precompile.py)
        if precompile.active():
            with precompile.dry_run():
                self.sampler.warm_up()
                self.runner.compile_ahead(self.max_model_len)
            precompile.wait("sampler and graph capture")
        self.sampler.warm_up()
        self.runner.capture(self.max_model_len)
        # [async] pure-decode steps launched ahead of the host's bookkeeping (see "Async scheduling" above); on
        # where graphs are unless the config says otherwise (EngineConfig refuses it with speculation or ranks)
        self.async_scheduling = engine_config.async_scheduling if engine_config.async_scheduling is not None \
            else self.runner.capturable and spec is None
        self._inflight: _Launched | None = None      # the launched decode step whose ids the host has not read
        self._gather = torch.zeros(self.scheduler.max_num_seqs, dtype=torch.long, device=self.device)
        self._copy_events = [torch.cuda.Event(), torch.cuda.Event()] if self.device.type == "cuda" else []
        # the pinned host buffers of those copies, used in the events' turn (a launch's buffer is read by its
        # `_complete` before the launch after next takes it again); grown when a step packs logprobs
        self._copy_bufs = [torch.empty(8 * self.scheduler.max_num_seqs, dtype=torch.uint8, pin_memory=True)
                           for _ in self._copy_events]
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(engine_config.seed)
        self.eos_ids = set(config.eos_token_ids)
        if tokenizer is not None:
            self.eos_ids |= set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.num_steps = 0
        self.finished_count = {"stop": 0, "length": 0, "abort": 0}
        # seconds spent per phase of step(), summed over steps (the benchmark reports them)
        # host seconds per phase; "model_device": the model's device time where the runner is timed (CUDA events).
        # Under async scheduling a steady step's phases are: schedule (the next step's one-token-each plan), build
        # and model (its inputs and launch), sample (its sampling launch, then the wait for the PREVIOUS step's ids:
        # what the host waits on the device lands here, as in a synchronous step), output (the previous step's
        # bookkeeping, while the launched step runs)
        self.timing = {"schedule": 0.0, "build": 0.0, "model": 0.0, "sample": 0.0, "output": 0.0,
                       "model_device": 0.0}
        if self.proposer is not None:
            self.timing["draft"] = 0.0

    # ---- requests ------------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this checkpoint has no tokenizer: pass token ids instead of text")
            return prompt, self.tokenizer.encode(prompt)
        # one C-level pass over the types (a generator over an 8K prompt cost ~1 ms of the prefill's host time;
        # counting the exact-int types, 0.10 ms, beats building their set, 0.13); exact int only: bool (an int
        # subclass) and other subclasses are refused as before
        if not isinstance(prompt, (list, tuple)) or operator.countOf(map(type, prompt), int) != len(prompt):
            raise RequestError("prompt must be a string or a list of token ids")
        return None, list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, grammar=None) -> str:
        """Validate and queue a request; a bad one raises RequestError and leaves the engine untouched.
        `grammar` (see `Request.grammar`) constrains every sampled token; the request stops when it is finished."""
        params = params or SamplingParams()
        params.validate()
        text, ids = self.encode(prompt)
        if not ids:
            raise RequestError("prompt is empty: give at least one token")
        # the ids as one int64 buffer (Request.prompt_array), converted once; its min and max in C (Python's
        # min and max over an 8K list cost 0.19 ms, about what the conversion does); an id past int64 cannot be
        # stored and is outside the vocabulary anyway
        try:
            arr = array("q", ids)
            lo, hi = (int(v) for v in torch.aminmax(torch.frombuffer(arr, dtype=torch.long)))
        except OverflowError:
            arr, lo, hi = None, -1, -1
        if lo < 0 or hi >= self.config.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.config.vocab_size)
            raise RequestError(f"prompt token id {bad} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; the maximum context is {self.max_model_len} "
                               "(prompt plus at least one generated token): shorten the prompt or raise "
                               "--max-model-len")
        capacity = self.cache.max_pages_per_seq * self.cache.page_size
        if len(ids) + 1 > capacity:
            raise RequestError(f"prompt has {len(ids)} tokens but the whole KV cache holds {capacity}: shorten the "
                               "prompt or give the cache more memory (--kv-cache-tokens)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2 ** 62, (1,), generator=self._seed_rng))
        req = Request(rid, ids, params, seed, prompt=text, sample_row=self.sampler.row(params, seed),
                      text_state=TextState(self._detokenizer(ids), params.stop or []),
                      max_len=min(self.max_model_len, capacity), grammar=grammar, prompt_array=arr)
        req.metrics.prompt_tokens = len(ids)
        if grammar is not None:
            self._num_grammars += 1
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a waiting or running request now: its pages and slot go back at once. Returns its final output
        (finish_reason "abort"), or None if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return None
        later = self._writes_later(req)
        self.scheduler.abort(req, release=not later)
        self._finish(req, "abort")
        return RequestOutput.of(req, req.text_state.flush())

    def _detokenizer(self, prompt_ids: list[int]):
        if self.tokenizer is None:
            return None
        from kestrel.tokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(self.tokenizer, prompt_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # ---- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one model step (two launched under async scheduling) and return the outputs of the step that
        finished: one per request that got a token, in the step's order."""
        if not self.async_scheduling:
            return self._step_sync()
        prev = self._inflight
        t0 = time.perf_counter()
        if prev is None:
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return self._unstick()
            if not self._overlappable(scheduled):
                return self._step_sync(scheduled, t0)
            self._mark_scheduled(scheduled)
            prev = self._launch([s.req for s in scheduled], None, t0)
            t0 = time.perf_counter()
        self._inflight = None
        try:
            ahead = self._plan_ahead(prev)
            if ahead is not None:
                self._inflight = self._launch(ahead, prev, t0)
        except BaseException:
            # prev may still be running: it stays in flight, so what ends now (aborts) is released after it
            self._inflight = prev
            raise
        return self._complete(prev)

    def _step_sync(self, scheduled: list[Scheduled] | None = None, t0: float | None = None) -> list[RequestOutput]:
        """One step, start to end: schedule (unless given), build, run, sample, read the ids, bookkeeping."""
        if scheduled is None:
            t0 = time.perf_counter()
            if self.policy is not None:
                self.policy.begin_step(sum(1 for r in self.scheduler.running if r.is_decoding))
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return self._unstick()
        t1 = time.perf_counter()
        self._mark_scheduled(scheduled)
        pure_decode = all(s.req.is_decoding for s in scheduled)
        self.cache.flush_block_tables()
        draft, draft_s = self._propose(scheduled)
        t1d = time.perf_counter()
        batch, samplers, blocks = self._build_batch(scheduled, draft)
        t2 = time.perf_counter()
        try:
            logits = self.runner(batch)       # [graphs]
        except BaseException:
            # the snapshots this step promised were never written: a later hit must not restore them
            self.cache.forget_snapshots([slot for _, slot in batch.snapshots])
            raise
        # the drafter's context write, unless the replayed graph ran it (runtime/graphs.py: observe_in_graphs)
        observed = self.runner.observed and self.runner.proposer is self.proposer
        if self.proposer is not None and self.proposer.capture_layers and not observed:
            self.proposer.observe(batch, getattr(self.model, "captured_hidden", None) or {}, self.cache.pools)
        t3 = time.perf_counter()
        self.num_steps += 1
        accepted = self._accept(logits, scheduled, blocks, draft) if blocks else []
        if accepted:
            self.runner.commit_verify([a + 1 for _, a in accepted])
        spec_out = {blk[0]: acc for blk, acc in zip(blocks, accepted)}     # scheduled index -> (tokens, a)
        for i, s in enumerate(scheduled):
            # a verify block computed its last token and the a accepted drafts; the new last token is not computed
            s.req.num_computed += spec_out[i][1] + 1 if i in spec_out else s.num_tokens
            self.cache.commit_pages(s.req)
            if self.proposer is not None:
                self.cache.trim(s.req)          # pages of rejected (or never proposed) drafts go back
        t4 = time.perf_counter() if accepted else t3
        plain: dict[int, RequestOutput] = {}
        if samplers:
            reqs = [scheduled[i].req for i, _ in samplers]
            rows = logits
            if blocks:
                rows = logits.index_select(0, torch.tensor([r for _, r in samplers], device=logits.device))
            tokens, lps = self._sample(rows, reqs)
            t4 = time.perf_counter()
            for (i, _), req, token, lp in zip(samplers, reqs, tokens, lps):
                plain[i] = self._append(req, token, lp)
        outputs = []
        for i, s in enumerate(scheduled):
            if i in plain:
                outputs.append(plain[i])
            elif i in spec_out:
                toks, a = spec_out[i]
                for tok in toks[:a + 1]:
                    outputs.append(self._append(s.req, tok, None))
                    if s.req.status == Status.FINISHED:
                        break
        t5 = time.perf_counter()
        if self.policy is not None:
            # the policy compares steps of decoding requests only (a prefill chunk would blur both times)
            if pure_decode:
                self.policy.record_step(bool(blocks), len(scheduled), t4 - t2, draft_s)
            if pure_decode or blocks:
                self.spec_stats.add_step(bool(blocks), t4 - t2, draft_s, [a for _, a in accepted],
                                         [n for _, _, n, _ in blocks])
        tm = self.timing
        tm["schedule"] += t1 - t0
        if self.proposer is not None:
            tm["draft"] += t1d - t1
        tm["build"] += t2 - t1d
        tm["model"] += t3 - t2
        tm["sample"] += t4 - t3
        tm["output"] += t5 - t4
        device_s = self.runner.take_model_time()
        if device_s is not None:
            tm["model_device"] += device_s
        return outputs

    def _mark_scheduled(self, scheduled: list[Scheduled]) -> None:
        now = time.monotonic()
        for s in scheduled:
            if s.req.metrics.first_scheduled is None:
                s.req.metrics.first_scheduled = now

    # ---- async scheduling ------------------------------------------------------------------------------------
    def _overlappable(self, scheduled: list[Scheduled]) -> bool:
        """Whether a step can be launched ahead of the host's bookkeeping: every entry a plain decode of a request
        whose tokens need nothing from the host (no grammar mask, no state hand-off)."""
        return self.token_bitmask is None and all(
            s.num_tokens == 1 and not s.drafts and s.req.is_decoding and s.req.grammar is None
            and s.req.handoff is None for s in scheduled)

    def _plan_ahead(self, prev: _Launched) -> list[Request] | None:
        """The next step, planned before `prev`'s ids are known (`Scheduler.plan_ahead`: every request of prev
        still running decodes the token prev sampled for it); None: the pipeline drains."""
        if self.token_bitmask is not None:
            return None
        return self.scheduler.plan_ahead([r for r in prev.reqs if r.status == Status.RUNNING])

    def _launch(self, reqs: list[Request], prev: _Launched | None, t0: float) -> _Launched:
        """Build, run and sample a pure-decode step of `reqs` and start the copy of its ids to the host, without
        waiting for anything. With `prev`, each request's input id is the one `prev` sampled for it, gathered on the
        device into the persistent input buffer (no host round trip), and its sampled position is one further."""
        t1 = time.perf_counter()
        self.cache.flush_block_tables()
        B = len(reqs)
        positions = [r.num_computed for r in reqs]
        # with prev, the token row holds each request's row of prev's ids until the gather below replaces it
        tokens = [r.output_token_ids[-1] for r in reqs] if prev is None else [prev.rows[id(r)] for r in reqs]
        batch = self.inputs.fill(tokens, positions, list(range(B + 1)), positions, [r.slot for r in reqs],
                                 list(range(B)), self.cache.block_tables, [])
        if prev is not None:
            ids = batch.token_ids[:B]
            if len(prev.reqs) == B and all(r is q for r, q in zip(reqs, prev.reqs)):
                ids.copy_(prev.token_ids)          # the same rows as prev: one copy
            else:                                  # rows were dropped: gather each request's row of prev
                torch.index_select(prev.token_ids, 0, ids, out=self._gather[:B])
                ids.copy_(self._gather[:B])
        t2 = time.perf_counter()
        logits = self.runner(batch)
        self.num_steps += 1
        for r in reqs:
            r.num_computed += 1
            self.cache.commit_pages(r)
        t3 = time.perf_counter()
        lag = 0 if prev is None else 1       # prev's token is not appended yet: this step draws the one after it
        result = self._sample_on_device(logits, reqs, [r.num_tokens + lag for r in reqs])
        packed = _pack(result)
        if self._copy_events:
            i = self.num_steps % 2
            nbytes = packed.numel() * packed.element_size()
            if self._copy_bufs[i].numel() < nbytes:
                self._copy_bufs[i] = torch.empty(max(nbytes, 2 * self._copy_bufs[i].numel()), dtype=torch.uint8,
                                                 pin_memory=True)
            host = self._copy_bufs[i][:nbytes].view(packed.dtype).view(packed.shape)
            host.copy_(packed, non_blocking=True)
            event = self._copy_events[i]
            event.record()
        else:
            host, event = packed, None
        tm = self.timing
        tm["schedule"] += t1 - t0
        tm["build"] += t2 - t1
        tm["model"] += t3 - t2
        tm["sample"] += time.perf_counter() - t3
        return _Launched(reqs, result.token_ids, host, event, {id(r): i for i, r in enumerate(reqs)})

    def _complete(self, step: _Launched) -> list[RequestOutput]:
        """Wait for a launched step's ids, release what ended while it could still write, and do its bookkeeping
        (append, logprobs, stop conditions, outputs). A request that ended since the step was launched (at the
        step before, or aborted) gets nothing: its row's token is dropped."""
        t0 = time.perf_counter()
        if step.event is not None:
            step.event.synchronize()
        for r in step.release_after:
            self.cache.release(r)
        rows = step.host.tolist()
        t1 = time.perf_counter()
        device_s = self.runner.take_model_time()
        if device_s is not None:
            self.timing["model_device"] += device_s
        live = [(r, row) for r, row in zip(step.reqs, rows) if r.status == Status.RUNNING]
        tokens, lps = _unpack([row for _, row in live], [r for r, _ in live])
        outputs = [self._append(r, t, lp) for (r, _), t, lp in zip(live, tokens, lps)]
        self.timing["sample"] += t1 - t0
        self.timing["output"] += time.perf_counter() - t1
        return outputs

    def _writes_later(self, req: Request) -> bool:
        """Whether a launched step not completed yet computes a row of `req`: then its pages and slot go back only
        after that step (`_Launched.release_after`), never to another request while the step may write them."""
        step = self._inflight          # it holds its requests: their ids are not reused while it lives
        if step is None or id(req) not in step.rows:
            return False
        step.release_after.append(req)
        return True

    # ---- speculation -----------------------------------------------------------------------------------------
    def _propose(self, scheduled: list[Scheduled]) -> tuple[DraftBlock | None, float]:
        """Fill the verify blocks' drafts from the proposer; a request it found nothing for decodes plainly. Returns
        the proposer's block (rows in `Scheduled.prob_row` order of the blocks) and the seconds it took. A block of
        K drafts a row (DSpark) stays on the device: the verify's input rows are written there (`_place_drafts`)
        and acceptance reads it there, so the host launches the verify without waiting for the propose; a block
        with `lengths` (n-gram, host work) comes as host lists."""
        spec = [s for s in scheduled if s.drafts]
        if not spec:
            return None, 0.0
        t0 = time.perf_counter()
        history = getattr(self.proposer, "reads_history", True)
        inputs = [DraftInput(s.req.all_token_ids if history else _token_slice(s.req, s.req.num_computed,
                                                                              s.req.num_computed + 1),
                             s.req.num_computed, s.req.slot, s.req.seed, s.req.params.temperature) for s in spec]
        block = self.proposer.propose(inputs, self.cache.block_tables, self.cache.pools)
        if block.lengths is None:
            if block.tokens.device != self.device:       # a host proposer's full rows: moved once, here
                block = dataclasses.replace(block, tokens=block.tokens.to(self.device))
            for row, s in enumerate(spec):
                s.drafts = min(s.drafts, block.tokens.shape[1])
                s.num_tokens = 1 + s.drafts
                s.draft_tokens = None
                s.prob_row = row
            return block, time.perf_counter() - t0
        toks = block.tokens.tolist()
        for row, (s, t, n) in enumerate(zip(spec, toks, block.lengths)):
            s.drafts = min(s.drafts, n)
            s.num_tokens = 1 + s.drafts
            s.draft_tokens = t[:s.drafts]
            s.prob_row = row
        return block, time.perf_counter() - t0

    def _accept(self, logits: torch.Tensor, scheduled: list[Scheduled], blocks, draft: DraftBlock) -> list:
        """Acceptance of every verify block of the step on the device, one copy back: (tokens, a) per block."""
        res = self._accept_on_device(logits, scheduled, blocks, draft)
        host = torch.cat([res.tokens, res.num_accepted.unsqueeze(1)], 1).tolist()
        out = []
        for row, policy_row in zip(host, blocks):
            a = int(row[-1])
            out.append((row[:-1], a))
            self.policy.record_acceptance(scheduled[policy_row[0]].req.request_id, a)
        return out

    def _accept_on_device(self, logits: torch.Tensor, scheduled: list[Scheduled], blocks,
                          draft: DraftBlock) -> Accepted:
        """`accept` over the step's verify blocks, launched without a host sync: its host inputs (logits rows,
        lengths, draft rows, the sampler's packed rows, host drafts) go up in two pinned copies that do not wait for
        the stream (a plain `torch.tensor(..., device=cuda)` waits for the verify to finish, and every acceptance
        kernel after it then waits for its own launch), so the host queues acceptance right behind the verify."""
        K = self.proposer.num_tokens
        dev = logits.device
        idx, drafts, lengths, ints, floats, prob_rows = [], [], [], [], [], []
        for i, first, n, _ in blocks:
            s = scheduled[i]
            idx += [first + min(j, n) for j in range(K + 1)]
            if s.draft_tokens is not None:
                drafts += s.draft_tokens + [0] * (K - n)
            lengths.append(n)
            (k0, k1, top_k, path), f = s.req.sample_row
            ints.append((k0, k1, s.req.num_tokens, top_k, path))
            floats.append(f)
            prob_rows.append(s.prob_row)
        B = len(blocks)
        ints_t = torch.tensor(ints, dtype=torch.int64).T.contiguous()
        packed = _upload(torch.cat([torch.tensor(idx + lengths + prob_rows + drafts, dtype=torch.int64),
                                    ints_t.view(-1)]), dev)
        idx_d, lengths_d, rows_d, drafts_d, ints_d = packed.split([B * (K + 1), B, B, len(drafts), 5 * B])
        floats_d = _upload(torch.tensor(floats, dtype=torch.float32).T.contiguous(), dev)
        logit_rows = logits.index_select(0, idx_d).view(B, K + 1, -1)
        q = None if draft.probs is None else draft.probs.index_select(0, rows_d.to(draft.probs.device))
        # device drafts past a row's n are real tokens, host ones zeros: acceptance reads only the first n
        drafts_t = drafts_d.view(B, K) if drafts else draft.tokens.index_select(0, rows_d)
        return accept(logit_rows, drafts_t, lengths_d, q, ints_d.view(5, B), floats_d, frozenset(ints_t[4].tolist()))

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list]:
        """One token per request on the device and one copy back (ids and, when asked for, logprobs together)."""
        result = self._sample_on_device(logits, reqs, [r.num_tokens for r in reqs])
        return _unpack(_pack(result).tolist(), reqs)

    def _sample_on_device(self, logits: torch.Tensor, reqs: list[Request], positions: list[int]):
        """The step's SampleResult on the device; `positions`: of the token each request draws (its seed stream)."""
        wants = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
        flags = self.sampler.prepare([r.sample_row for r in reqs], positions, max(wants) if wants else None)
        if self.token_bitmask is not None:
            mask = self.token_bitmask(reqs)
        else:
            mask = self._grammar_bitmask(reqs) if self._num_grammars else None
        return self.sampler.sample(logits, flags, mask)

    def _grammar_bitmask(self, reqs: list[Request]) -> torch.Tensor | None:
        """The step's int32 [B, ceil(V/32)] bitmask on the device (bit 1 = allowed) when any sampled request
        carries a grammar: each grammar fills its row on the host, rows without one allow everything, one copy."""
        if not any(r.grammar is not None for r in reqs):
            return None
        if self._host_bitmask is None:
            shape = (self.scheduler.max_num_seqs, (self.config.vocab_size + 31) // 32)
            pin = self.device.type == "cuda"
            self._host_bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=pin)
            self._device_bitmask = (self._host_bitmask if self.device.type == "cpu"
                                    else torch.empty(shape, dtype=torch.int32, device=self.device))
        host = self._host_bitmask[:len(reqs)]
        for b, r in enumerate(reqs):
            if r.grammar is None:
                host[b].fill_(-1)
            else:
                r.grammar.fill(host[b])
        dev = self._device_bitmask[:len(reqs)]
        if dev.data_ptr() != host.data_ptr():
            dev.copy_(host, non_blocking=True)
        return dev

    def _build_batch(self, scheduled: list[Scheduled], draft: DraftBlock | None = None
                     ) -> tuple[StepBatch, list[tuple[int, int]], list]:
        """Flat tokens of every scheduled request. A prompt chunk is cut at each page boundary whose KDA state the
        prefix cache wants, so the model can snapshot it there. Returns the batch (views of the persistent input
        buffers), the scheduled entries that get a sampled token (their chunk reaches the end of their tokens) with
        their logits row, and the verify blocks: (entry, first logits row, drafts, segment). Drafts that stay on the
        device (`draft`) are written into the input rows after the host's copy."""
        # tokens: one int64 buffer that prompt chunks join as C slices of Request.prompt_array; positions are not
        # listed: every segment's run from its first position on, `StepInputs.fill` writes them vectorized (an 8K
        # prefill's per-token lists and their conversion cost ~0.4 ms of host time before the step could launch)
        tokens, cu, ctx, slots, logits_rows, samplers, snaps = array("q"), [0], [], [], [], [], []
        blocks, on_device = [], []
        ps = self.cache.page_size
        snapshots_on = self.cache.prefix_caching and self.cache.num_snapshots > 0
        for i, s in enumerate(scheduled):
            req, start, end = s.req, s.req.num_computed, s.req.num_computed + s.num_tokens
            if s.drafts:                     # a verify block: the last token, then the drafts; logits on every row
                blocks.append((i, len(logits_rows), s.drafts, len(cu) - 1))
                if s.draft_tokens is None:       # placeholders until `_place_drafts`
                    on_device.append((len(tokens), s.prob_row, s.drafts))
                    tokens.extend(_token_slice(req, start, start + 1) * (1 + s.drafts))
                else:
                    tokens.extend(_token_slice(req, start, start + 1) + s.draft_tokens)
                ctx.append(start)
                slots.append(req.slot)
                logits_rows += range(cu[-1], cu[-1] + s.num_tokens)
                cu.append(cu[-1] + s.num_tokens)
                continue
            if snapshots_on and start < len(req.prompt_token_ids) - 1:
                cuts = [b for b in range((start // ps + 1) * ps, end + 1, ps) if self.cache.snapshot_wanted(req, b)]
            else:
                cuts = []
            cut_at = set(cuts)        # a set: an 8K prompt has 127 cuts, and each segment asks
            for a, b in zip([start] + cuts, cuts + [end]):
                if a == b:
                    continue
                tokens.extend(_token_run(req, a, b))
                ctx.append(a)
                slots.append(req.slot)
                cu.append(cu[-1] + b - a)
                if b in cut_at:
                    snaps.append((len(cu) - 2, self.cache.take_snapshot_slot(req.page_hashes[b // ps - 1])))
            if end == req.num_tokens:
                samplers.append((i, len(logits_rows)))
                logits_rows.append(cu[-1] - 1)
        batch = self.inputs.fill(tokens, None, cu, ctx, slots, logits_rows, self.cache.block_tables, snaps,
                                 tuple(seg for _, _, _, seg in blocks))
        if on_device:
            _place_drafts(batch.token_ids, draft.tokens, on_device)
        return batch, samplers, blocks

    def _append(self, req: Request, token: int, lp) -> RequestOutput:
        now = time.monotonic()
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        req.output_token_ids.append(token)
        req.metrics.generated_tokens += 1
        if lp is not None:
            req.output_logprobs.append(lp)
        p = req.params
        reason = None
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= req.max_len:
            reason = "length"
        visible = reason != "stop"       # the eos / stop token that ended the request is not shown as text
        if req.grammar is not None and reason is None:
            if not req.grammar.accept(token):     # only a sampler that skipped the mask gets here
                log.warning("request %s: token %d broke its grammar; it runs on unconstrained", req.request_id,
                            token)
                self._drop_grammar(req)
            elif req.grammar.is_finished:        # the constrained output is complete: nothing may follow
                reason = "stop"
        ts = req.text_state
        delta, stopped = ts.add(token, final=reason is not None) if visible else ("", False)
        if stopped:
            reason = "stop"
        if reason is not None:
            try:
                if req.handoff is not None:      # disaggregated serving: copy the state out before it goes back
                    req.handoff(req)
            finally:
                self.scheduler.finish(req, release=not self._writes_later(req))
            self._finish(req, reason)
            delta += ts.flush()
        return RequestOutput.of(req, delta, [token], [lp] if lp is not None else None)

    def _drop_grammar(self, req: Request) -> None:
        if req.grammar is not None:
            req.grammar = None
            self._num_grammars -= 1

    def _finish(self, req: Request, reason: str) -> None:
        self._drop_grammar(req)
        if self.policy is not None:
            self.policy.forget(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.metrics.finished = time.monotonic()
        self.finished_count[reason] = self.finished_count.get(reason, 0) + 1

    def final_output(self, request_id: str) -> RequestOutput:
        """The request's output with no delta: the whole result once it has finished."""
        return RequestOutput.of(self.requests[request_id])

    def release(self, request_id: str) -> None:
        """Forget a finished request (its outputs keep what they show)."""
        self.requests.pop(request_id, None)

    def _unstick(self) -> list[RequestOutput]:
        """Nothing could be scheduled although requests wait: the head request does not fit even alone (its
        generation outgrew the pool). End it with `length` rather than spin."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        req = self.scheduler.waiting.popleft()
        self._finish(req, "length")
        return [RequestOutput.of(req, req.text_state.flush())]

    # ---- stats ---------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "cache_usage": self.cache.usage(), "prefix_hit_rate": self.cache.hit_rate(),
                "prefix_hit_tokens": self.cache.hit_tokens, "used_pages": self.cache.used_pages,
                "used_slots": self.cache.used_slots, "preemptions": self.scheduler.num_preemptions,
                "steps": self.num_steps, **({"spec": self.spec_stats.as_dict()} if self.spec_stats else {})}


class SpecStats:
    """Speculation counters since start: verify blocks, drafted / accepted tokens, the acceptance-length
    histogram (tokens a block emitted: accepted drafts + 1), and the step time split (the proposer's time, steps
    that verify, pure decode steps; model + sampling / acceptance, device synchronized by the copy back)."""

    def __init__(self, k: int):
        self.k = k
        self.blocks = self.drafted = self.accepted = self.verify_steps = self.decode_steps = 0
        self.accept_len_hist = [0] * (k + 2)           # index L = tokens emitted by a block (1..K+1)
        self.draft_s = self.verify_s = self.decode_s = 0.0

    def add_step(self, verify: bool, seconds: float, draft_s: float, accepted: list[int], drafted: list[int]):
        if not verify:
            self.decode_steps += 1
            self.decode_s += seconds
            return
        self.verify_steps += 1
        self.verify_s += seconds
        self.draft_s += draft_s
        self.blocks += len(accepted)
        self.drafted += sum(drafted)
        self.accepted += sum(accepted)
        for a in accepted:
            self.accept_len_hist[a + 1] += 1

    def as_dict(self) -> dict:
        emitted = self.accepted + self.blocks
        return {"num_speculative_tokens": self.k, "verify_blocks": self.blocks, "draft_tokens": self.drafted,
                "accepted_tokens": self.accepted, "verify_steps": self.verify_steps,
                "decode_steps": self.decode_steps,
                "mean_accept_len": emitted / self.blocks if self.blocks else 0.0,
                "accepted_per_step": self.accepted / self.verify_steps if self.verify_steps else 0.0,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "accept_len_hist": {str(i): n for i, n in enumerate(self.accept_len_hist) if i},
                "draft_s": round(self.draft_s, 6), "verify_s": round(self.verify_s, 6),
                "decode_s": round(self.decode_s, 6)}


@dataclass
class _Launched:
    """A pure-decode step launched on the device whose sampled ids the host has not read yet (async scheduling)."""
    reqs: list[Request]                # row i's request
    token_ids: torch.Tensor            # [B] its sampled ids on the device (the next step's input ids come from here)
    host: torch.Tensor                 # their host copy (pinned on a GPU; `_pack`'s rows), ready once `event` is
    event: object                      # a CUDA event after the copy; None on the CPU (the copy is done)
    rows: dict[int, int]               # id(request) -> its row
    # requests that ended while this step could still write their pages and slot: released once it completed
    release_after: list[Request] = field(default_factory=list)


def _pack(result) -> torch.Tensor:
    """A SampleResult as one device tensor for one copy back: the ids [B], or [B, 1 + logprobs] float64 rows."""
    if result.logprobs is None:
        return result.token_ids
    return torch.cat([result.token_ids.unsqueeze(1).double(), result.logprobs], 1)


def _unpack(rows: list, reqs: list[Request]) -> tuple[list[int], list]:
    """`_pack`'s rows on the host -> the tokens and, for requests that asked for them, their logprobs."""
    if not rows or not isinstance(rows[0], list):
        return rows, [None] * len(reqs)
    lps = unpack_logprobs([row[1:] for row in rows])
    return [int(row[0]) for row in rows], [lp if r.params.logprobs is not None else None for lp, r in zip(lps, reqs)]


def _place_drafts(token_ids: torch.Tensor, drafts: torch.Tensor, blocks: list[tuple[int, int, int]]) -> None:
    """Write device drafts [P, K] into a step's input ids: per block (its first token's row, its row of drafts, n),
    the first n drafts into the rows after its first token. One copy when the step is full blocks of K in draft
    order from row 0 (a verify graph's step), else one gather and one scatter (two small index uploads that do not
    wait for the stream)."""
    K = drafts.shape[1]
    B = len(blocks)
    if all(first == i * (K + 1) and row == i and n == K for i, (first, row, n) in enumerate(blocks)):
        token_ids[:B * (K + 1)].view(B, K + 1)[:, 1:].copy_(drafts[:B])
        return
    dst = [first + 1 + j for first, _, n in blocks for j in range(n)]
    src = [row * K + j for _, row, n in blocks for j in range(n)]
    dev = token_ids.device
    picked = drafts.reshape(-1).index_select(0, torch.tensor(src).to(dev, non_blocking=True))
    token_ids.index_copy_(0, torch.tensor(dst).to(dev, non_blocking=True), picked)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the stream: through pinned memory (torch's caching host
    allocator keeps the block until the copy is done) on a GPU; itself on the CPU."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _token_run(req: Request, a: int, b: int):
    """Tokens a..b-1 as `_token_slice`, but a run inside the prompt as a slice of its int64 buffer (one memcpy)."""
    if b <= len(req.prompt_token_ids) and req.prompt_array is not None:
        return req.prompt_array[a:b]
    return _token_slice(req, a, b)


def _token_slice(req: Request, a: int, b: int) -> list[int]:
    """Tokens a..b-1 of prompt + output, without building the whole list."""
    prompt, out = req.prompt_token_ids, req.output_token_ids
    P = len(prompt)
    if b <= P:
        return prompt[a:b]
    if a >= P:
        return out[a - P:b - P]
    return prompt[a:] + out[:b - P]


class AsyncEngine:
    """Runs `Engine.step()` in a background task; each request's outputs stream through its own queue
    (`Request.stream`)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self.error: BaseException | None = None

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                async with self._lock:
                    outputs = await loop.run_in_executor(None, self.engine.step)
            except Exception as e:        # a failed step fails every request in flight, never hangs them
                log.exception("engine step failed")
                self.error = e
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out)
            await asyncio.sleep(0)

    def _deliver(self, out: RequestOutput) -> None:
        req = self.engine.requests.get(out.request_id)
        if req is not None and req.stream is not None:
            req.stream.put_nowait(out)
        if out.finished:
            self.engine.release(out.request_id)

    def _fail_all(self, e: BaseException) -> None:
        for rid, req in list(self.engine.requests.items()):
            self.engine.abort(rid)
            self.engine.release(rid)
            if req.stream is not None:
                req.stream.put_nowait(e)

    async def generate(self, prompt, params: SamplingParams | None, request_id: str, grammar=None, on_add=None):
        """Async iterator of RequestOutputs, one per new token: `delta_text` / `delta_token_ids` / `delta_logprobs`
        are what is new; the last one has finish_reason set ("abort" after `abort`) and the whole `text`,
        `token_ids` and `logprobs`. `on_add(engine, request)`, when given, runs under the engine lock right after
        the request is queued and returns outputs to deliver at once (runtime/handoff.py: a generation server
        imports a transferred state there)."""
        self._ensure_loop()
        q: asyncio.Queue = asyncio.Queue()
        async with self._lock:
            rid = self.engine.add_request(prompt, params, request_id, grammar=grammar)
            self.engine.requests[rid].stream = q
            if on_add is not None:
                try:
                    for out in on_add(self.engine, self.engine.requests[rid]):
                        self._deliver(out)
                except BaseException:
                    self.engine.abort(rid)
                    self.engine.release(rid)
                    raise
        self._wakeup.set()
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            req = self.engine.requests.get(rid)
            if req is not None:
                req.stream = None
            if req is not None and req.status != Status.FINISHED:   # the caller stopped reading: free its cache
                async with self._lock:
                    self.engine.abort(rid)
                    self.engine.release(rid)

    async def abort(self, request_id: str) -> None:
        """Stop a request: its pages and slot are freed now, and its stream ends with finish_reason "abort"."""
        async with self._lock:
            out = self.engine.abort(request_id)
            if out is not None:
                self._deliver(out)
