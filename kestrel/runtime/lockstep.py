"""The lockstep driver: one scheduler drives the ranks of a layout, step by step.

Two forms, by layout (kestrel/parallel/mapping.py):
- **One attention group** (tp, helix: dp = 1). Rank 0 runs the `Engine` (scheduler, cache bookkeeping, sampler);
  its model is a `LockstepModel`, which broadcasts each step's `StepBatch` (host lists and the used columns of the
  block table) and the cache-state operations done since the last step (a new request's slot reset, a prefix hit's
  snapshot restore) before running its own part. The other ranks (`follow`) apply the same operations to their
  pools and run the same step on their part of the weights; the model's collectives keep them together. Only
  rank 0 samples (every rank computes the same replicated logits).
- **Data-parallel ranks** (dep: dp > 1). Every rank runs its own `Engine` over the requests it owns. Rank 0's
  `DPEngine` (same interface as `Engine`) places each new request on the least-loaded rank; each step it broadcasts
  the new requests and aborts, every rank runs one engine step (a rank with no work runs the model on zero tokens,
  so it still joins the MoE's collectives), and the ranks' outputs are gathered on rank 0.

The driver adds no per-token work beyond one broadcast (and, for DP, one gather) per step. A rank that dies breaks
the collectives; the launcher (kestrel/parallel/launch.py) then stops the group and names the rank.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from kestrel.models.kimi.step import StepBatch
from kestrel.parallel import comm
from kestrel.runtime.cache import HybridCache
from kestrel.runtime.request import Metrics, RequestOutput

log = logging.getLogger("kestrel.lockstep")

STOP = "stop"


class RecordingCache(HybridCache):
    """The leader's cache: records the operations on the state pools it makes outside the model, so that the
    followers' pools stay the same (slot resets, snapshot restores)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool_ops: list[tuple] = []

    def acquire_slot(self, req) -> bool:
        ok = super().acquire_slot(req)
        if ok:
            self.pool_ops.append(("reset", req.slot))
        return ok

    def _copy_state(self, src: int, dst: int) -> None:
        super()._copy_state(src, dst)
        self.pool_ops.append(("copy", src, dst))


def apply_pool_ops(pools, ops: list[tuple]) -> None:
    for op in ops:
        if op[0] == "reset":
            pools.reset_slots([op[1]])
        else:
            for pool in list(pools.conv.values()) + list(pools.recurrent.values()):
                pool[op[2]].copy_(pool[op[1]])


def pack_batch(batch: StepBatch, page_size: int) -> dict:
    """The step as host data (what a follower needs to run it): the block table only as far as the step reads."""
    B = batch.num_reqs
    n = max((batch.context_lens[b] + batch.seq_len(b) for b in range(B)), default=0)
    cols = min(batch.block_tables.shape[1], -(-n // page_size))
    return {"token_ids": batch.token_ids.cpu(), "positions": batch.positions.cpu(), "cu": list(batch.cu_seqlens),
            "ctx": list(batch.context_lens), "slots": batch.slots.cpu(), "bt": batch.block_tables[:B, :cols].cpu(),
            "logits": batch.logits_indices.cpu(), "snapshots": list(batch.snapshots), "padded": batch.padded_rows}


def unpack_batch(m: dict, device: torch.device) -> StepBatch:
    return StepBatch(token_ids=m["token_ids"].to(device), positions=m["positions"].to(device), cu_seqlens=m["cu"],
                     context_lens=m["ctx"], slots=m["slots"].to(device), block_tables=m["bt"].to(device),
                     logits_indices=m["logits"].to(device), snapshots=m["snapshots"], host_slots=m["slots"].tolist(),
                     padded_rows=m["padded"])


class LockstepModel:
    """Rank 0's model in one attention group: broadcast the step, then run this rank's part of it."""

    capturable = False       # the collectives and the followers' steps are not in a CUDA graph

    def __init__(self, model, cache: RecordingCache):
        self.model, self.cache = model, cache
        self.config = model.config
        self.stopped = False

    def __call__(self, batch: StepBatch, pools) -> torch.Tensor:
        ops, self.cache.pool_ops = self.cache.pool_ops, []
        comm.broadcast_object({"batch": pack_batch(batch, self.cache.page_size), "ops": ops})
        return self.model(batch, pools)

    def parameters(self):
        return self.model.parameters()

    def stop(self) -> None:
        """Release the followers (they return from `follow`)."""
        if not self.stopped:
            self.stopped = True
            comm.broadcast_object(STOP)


def follow(model, pools, device: torch.device) -> int:
    """A follower rank of one attention group: run every step rank 0 broadcasts until it stops; returns the
    number of steps run."""
    steps = 0
    while True:
        msg = comm.broadcast_object(None)
        if msg == STOP:
            return steps
        apply_pool_ops(pools, msg["ops"])
        model(unpack_batch(msg["batch"], device), pools)
        steps += 1


# ---------------------------------------------------------------------------------------------------------------
# data-parallel ranks

def empty_batch(cache: HybridCache) -> StepBatch:
    """Zero tokens: what a rank without work runs, so that it joins the step's MoE collectives."""
    d = cache.device
    none = torch.zeros(0, dtype=torch.long, device=d)
    return StepBatch(token_ids=none, positions=none, cu_seqlens=[0], context_lens=[], slots=none,
                     block_tables=cache.block_tables[:0], logits_indices=none, host_slots=[])


def _dp_step(engine, aborted: list[RequestOutput]) -> tuple[list[tuple], bool]:
    """One engine step on this DP rank (exactly one model call: an empty one when nothing ran) and its outputs
    (`aborted`'s first) as plain data."""
    before = engine.num_steps
    outs = aborted + engine.step()
    if engine.num_steps == before:
        engine.model(empty_batch(engine.cache), engine.cache.pools)
    packed = [(o.request_id, o.delta_text, list(o.delta_token_ids), list(o.delta_logprobs), o.finish_reason,
               o.metrics) for o in outs]
    for o in outs:
        if o.finished:
            engine.release(o.request_id)
    return packed, engine.has_unfinished()


def _apply_command(engine, cmd: dict, rank: int) -> list[RequestOutput]:
    """Add this rank's new requests, abort the ones asked; returns the aborted requests' final outputs."""
    for dp, rid, ids, params in cmd["add"]:
        if dp == rank:
            engine.add_request(ids, params, request_id=rid)
    outs = []
    for rid in cmd["abort"]:
        if rid in engine.requests:
            out = engine.abort(rid)
            if out is not None:
                outs.append(out)
    return outs


def dp_follow(engine, rank: int) -> None:
    """A data-parallel rank other than 0: add the requests rank 0 gives it, step when the group steps."""
    while True:
        cmd = comm.broadcast_object(None)
        if cmd == STOP:
            return
        comm.gather_objects(_dp_step(engine, _apply_command(engine, cmd, rank)))


class _Pieces:
    def __init__(self):
        self.pieces: list[str] = []

    def text(self, upto: int | None = None) -> str:
        return "".join(self.pieces if upto is None else self.pieces[:upto])


class _RemoteRequest:
    """Rank 0's record of a request, built from the outputs its DP rank sends (RequestOutput reads the same fields
    it reads from a local Request)."""

    def __init__(self, rid: str, prompt: str | None, ids: list[int]):
        self.request_id, self.prompt, self.prompt_token_ids = rid, prompt, ids
        self.finish_reason = None
        self.output_token_ids: list[int] = []
        self.output_logprobs: list = []
        self.text_state = _Pieces()
        self.metrics = Metrics(prompt_tokens=len(ids))
        self.stream = None             # AsyncEngine's queue of this request's outputs

    @property
    def status(self):
        from kestrel.runtime.request import Status
        return Status.FINISHED if self.finish_reason is not None else Status.RUNNING


class DPEngine:
    """Rank 0 of data-parallel ranks: the engine interface (`add_request`, `step`, `has_unfinished`, `abort`,
    `final_output`, `release`) over every rank's engine; rank 0's own requests live in its local `Engine`."""

    def __init__(self, engine, mapping):
        self.local, self.mapping = engine, mapping
        self.config, self.tokenizer, self.cache = engine.config, engine.tokenizer, engine.cache
        self.engine_config, self.eos_ids = engine.engine_config, engine.eos_ids
        self.max_model_len = engine.max_model_len
        self.remote: dict[str, _RemoteRequest] = {}
        self.requests = self.remote        # what AsyncEngine reads: every request's record, with its stream
        self.owner: dict[str, int] = {}
        self.load = [0] * mapping.dp
        self._unfinished = [False] * mapping.dp
        self._adds: list[tuple] = []
        self._aborts: list[str] = []
        self._ids = 0
        self.stopped = False

    def add_request(self, prompt, params=None, request_id: str | None = None, grammar=None) -> str:
        from kestrel.errors import RequestError
        from kestrel.sampling_params import SamplingParams
        if grammar is not None:    # the grammar state lives on rank 0, the sampling on the request's rank
            raise RequestError("constrained output (tools, response_format) is not served with "
                               "--data-parallel-size yet; use a tensor-parallel or Helix layout")
        params = params or SamplingParams()
        params.validate()
        text, ids = self.local.encode(prompt)
        if params.seed is None:       # drawn here, as one engine would, so a request's seed is the layout's choice
            params = replace(params, seed=int(torch.randint(0, 2 ** 62, (1,), generator=self.local._seed_rng)))
        rid = request_id if request_id is not None else f"req-{self._ids}"
        self._ids += 1
        dp = min(range(self.mapping.dp), key=lambda r: (self.load[r], r))
        if dp == 0:
            rid = self.local.add_request(ids, params, rid)       # validates like one engine (RequestError)
        else:
            self._check(ids, rid)
            self._adds.append((dp, rid, ids, params))
        self.remote[rid] = _RemoteRequest(rid, text, ids)      # rank 0's record of every request's outputs
        self.owner[rid] = dp
        self.load[dp] += 1
        self._unfinished[dp] = True
        return rid

    def _check(self, ids: list[int], rid: str) -> None:
        from kestrel.errors import RequestError
        if not ids:
            raise RequestError("prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if len(ids) >= self.local.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; the maximum context is {self.local.max_model_len}")
        if rid in self.owner:
            raise RequestError(f"request id {rid!r} is already in use")

    def has_unfinished(self) -> bool:
        return any(self._unfinished) or bool(self._adds)

    def step(self) -> list[RequestOutput]:
        cmd = {"add": self._adds, "abort": self._aborts}
        self._adds, self._aborts = [], []
        comm.broadcast_object(cmd)
        mine = _dp_step(self.local, [])
        every = comm.gather_objects(mine)
        outputs = []
        for r, (packed, unfinished) in enumerate(every):
            self._unfinished[r] = unfinished
            for rid, delta, ids, lps, reason, metrics in packed:
                outputs.append(self._output(r, rid, delta, ids, lps, reason, metrics))
        return outputs

    def _output(self, r, rid, delta, ids, lps, reason, metrics) -> RequestOutput:
        req = self.remote[rid]
        req.output_token_ids += ids
        req.output_logprobs += lps
        if delta:
            req.text_state.pieces.append(delta)
        req.metrics = metrics or req.metrics
        if reason is not None:
            req.finish_reason = reason
            self.load[r] -= 1
        return RequestOutput.of(req, delta, ids, lps or None)

    def abort(self, rid: str):
        """Rank 0's own request ends now (its final output is returned); another rank's at the next step (its
        final output comes from `step`)."""
        rec = self.remote.get(rid)
        if rec is None or rec.finish_reason is not None:
            return None
        if self.owner.get(rid) == 0:
            out = self.local.abort(rid)
            self.local.release(rid)
            if out is not None:
                return self._output(0, rid, out.delta_text, list(out.delta_token_ids), [], out.finish_reason,
                                    out.metrics)
            return None
        self._aborts.append(rid)
        return None

    def stats(self) -> dict:
        return {**self.local.stats(), "running": sum(self.load)}

    def final_output(self, rid: str) -> RequestOutput:
        return RequestOutput.of(self.remote[rid])

    def release(self, rid: str) -> None:
        self.remote.pop(rid, None)
        self.owner.pop(rid, None)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            comm.broadcast_object(STOP)


def portable(out: RequestOutput) -> RequestOutput:
    """A final output that can be pickled to another process (its record holds only ids, text and metrics)."""
    rec = _RemoteRequest(out.request_id, out.prompt, list(out.prompt_token_ids))
    rec.output_token_ids, rec.output_logprobs = list(out.token_ids), list(out.logprobs)
    rec.text_state.pieces = [out.text]
    rec.finish_reason, rec.metrics = out.finish_reason, out.metrics
    return RequestOutput.of(rec)
