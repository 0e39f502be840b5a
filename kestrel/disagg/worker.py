"""The routes a context or generation server adds to the OpenAI server (`kestrel serve --role ...`).

Context server: `POST /disagg/prefill/v1/completions` and `.../v1/chat/completions` take the client's request
body as it is, run each choice's prompt with max_tokens = 1 (the first token is sampled here, with the request's
seed, stop conditions and grammar), export each choice's state (runtime/handoff.py) into the `StateStore` and
answer the transfer ids, first tokens, seeds and timestamps.

Generation server: `POST /disagg/generate/v1/completions` and `.../v1/chat/completions` take the same body and the
context server's answer in the `X-Kestrel-Handoff` header. Before anything runs: the peers' handshake (cache
layouts; the first difference refuses with 409), then each choice's state is pulled and its checksum checked (a
mismatch is pulled once more, then the request fails with 502: never generated on half a state), and acknowledged
(in the background: the acknowledgement only frees the context server's copy).
Each choice then enters the engine with its state imported and its first token already emitted, and the answer
is the usual OpenAI response or stream.

Both: `GET /disagg/clock` (this process's steady clock) and `GET /disagg/status` (pool counts, held states).
A state that cannot be pulled because the context server's transport is gone (not listening, no answer in time,
the state no longer held) fails with 502 `context_state_lost`: the frontend then runs the request again on another
context server. A state that arrives but fails its checksum twice fails with 502 `kv_transfer_failed` (not retried).

Fault injection for tests only, with `KESTREL_DISAGG_FAULTS=1` in the server's environment, by a request header
`X-Kestrel-Fault`: on a generation server `flip=N` flips one byte of the first N pulls; on a context server
`kill=in-prefill` SIGKILLs the process once the prompt has run and its state is exported, before it answers, and
`kill=after-prefill` closes its state transport, answers, then SIGKILLs the process (the state dies with it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import signal
import time
import uuid
from array import array
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from kestrel.disagg.handshake import LayoutMismatch
from kestrel.disagg.transport import StateClient, StateServer, StateStore, TransportError, nixl_api
from kestrel.runtime.handoff import HandoffError, admit_imported, export_state, pool_device, verify
from kestrel.serve import protocol as P
from kestrel.serve.api import ClientGone, OpenAIServer

log = logging.getLogger("kestrel.disagg")

HANDOFF_HEADER = "x-kestrel-handoff"
TIMING_HEADER = "x-kestrel-timing"
FAULT_HEADER = "x-kestrel-fault"
STATE_LOST = "context_state_lost"       # the error code that tells the frontend to retry on another context server
KINDS = {"v1/completions": "completion", "v1/chat/completions": "chat"}


def prompt_digest(ids) -> str:
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).hexdigest()


class Worker:
    def __init__(self, server: OpenAIServer, role: str, layout: dict, host: str = "127.0.0.1",
                 hold: float = 30.0, timeout: float = 30.0, method: str = "auto"):
        self.server, self.role, self.layout, self.method = server, role, layout, method
        self.store = self.state_server = self.client = None
        if role == "context":
            self.store = StateStore(hold)
            self.state_server = StateServer(self.store, layout, host).start()
        elif role == "generation":
            self.client = StateClient(timeout, pin_memory=pool_device(server.engine.cache.pools).type == "cuda")
        # transfers block on the network: their own threads, so they never queue behind the engine's steps
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="kestrel-handoff")
        self.faults = os.environ.get("KESTREL_DISAGG_FAULTS") == "1"
        self._acks: set[asyncio.Task] = set()      # acknowledgements in flight (held: a bare task may be collected)
        self._add_routes(server._fastapi)

    def transport(self) -> dict:
        return self.state_server.describe() if self.state_server is not None else {}

    async def _io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _ack(self, address: str, transfers: list[dict]) -> None:
        """Tell the context server it may drop these states (they arrived, or they will never be used)."""
        for t in transfers:
            try:
                await self._io(self.client.ack, address, t["tid"])
            except HandoffError as e:       # the peer drops them on its own after --handoff-timeout
                log.warning("handoff %s: acknowledgement not delivered (%s)", t["tid"], e)

    def stop(self) -> None:
        self._pool.shutdown(wait=False)
        if self.state_server is not None:
            self.state_server.stop()

    # ---- routes --------------------------------------------------------------------------------------------
    def _add_routes(self, app) -> None:
        @app.get("/disagg/clock", include_in_schema=False)
        async def clock():
            return {"monotonic": time.monotonic(), "wall": time.time()}

        @app.get("/disagg/status", include_in_schema=False)
        async def status():
            c = self.server.engine.cache
            return {"role": self.role, "num_pages": c.num_pages, "num_slots": c.num_slots,
                    "used_pages": c.used_pages, "used_slots": c.used_slots, "free_pages": c.num_free_pages,
                    "free_slots": c.free_slot_count, "held_states": len(self.store) if self.store else 0,
                    "running": len(self.server.engine.scheduler.running),
                    "waiting": len(self.server.engine.scheduler.waiting)}

        for route, kind in KINDS.items():
            if self.role == "context":
                app.add_api_route(f"/disagg/prefill/{route}", self._prefill_route(kind), methods=["POST"],
                                  include_in_schema=False)
            elif self.role == "generation":
                app.add_api_route(f"/disagg/generate/{route}", self._generate_route(kind), methods=["POST"],
                                  include_in_schema=False)

    def _prefill_route(self, kind: str):
        async def prefill(request: Request):
            return await self.prefill(request, kind)
        return prefill

    def _generate_route(self, kind: str):
        async def generate(request: Request):
            return await self.generate(request, kind)
        return generate

    # ---- context side --------------------------------------------------------------------------------------
    async def prefill(self, request: Request, kind: str) -> Response:
        server, received = self.server, time.monotonic()
        try:
            prep = await server.parse_request(request, kind)
            results = await asyncio.gather(*(self._prefill_choice(ch) for ch in prep.choices))
        except P.APIError as e:
            return server._error(e)
        except ClientGone:
            return Response(status_code=499)
        answered = time.monotonic()
        for rec in results:
            rec["timing"].update(received=received, answered=answered)
        answer = {"transfers": results, "transport": self.transport(), "layout": self.layout}
        fault = request.headers.get(FAULT_HEADER, "") if self.faults else ""
        if fault == "kill=in-prefill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "kill=after-prefill":       # no pull can reach the state, then the process dies
            self.state_server.stop()
            return JSONResponse(answer, background=BackgroundTask(os.kill, os.getpid(), signal.SIGKILL))
        return answer

    async def _prefill_choice(self, ch) -> dict:
        engine = self.server.engine
        tid = f"{ch.request_id}-{uuid.uuid4().hex[:12]}"
        rec: dict = {}

        def handoff(req):       # in the engine's thread, right after the step that sampled the first token
            try:
                state = export_state(engine.cache.pools, req, len(req.prompt_token_ids))
            except Exception as e:          # this request fails; the step and the other requests go on
                log.warning("request %s: exporting its state failed (%s: %s)", req.request_id, type(e).__name__, e)
                rec["error"] = f"{type(e).__name__}: {e}"
                return
            self.store.put(tid, state)
            rec["exported"] = time.monotonic()
            lp = req.output_logprobs[0] if req.output_logprobs else None
            rec.update(tid=tid, first_token=req.output_token_ids[0], logprob=lp, seed=req.seed,
                       num_tokens=len(req.prompt_token_ids), nbytes=state.nbytes, checksum=state.checksum,
                       prompt=prompt_digest(req.prompt_token_ids), cached_tokens=req.metrics.cached_tokens)

        def on_add(engine, req):
            req.handoff = handoff
            return []

        params = dataclasses.replace(ch.params, max_tokens=1)      # the prompt and its first token, here
        final = None
        try:
            async for final in self.server.async_engine.generate(ch.prompt_ids, params, ch.request_id, ch.grammar,
                                                                 on_add=on_add):
                pass
        except Exception as e:
            raise P.APIError(500, f"the context server failed while running the prompt: {type(e).__name__}: {e}")
        if "error" in rec:
            raise P.APIError(500, f"the context server could not export the request's state: {rec['error']}",
                             code="export_failed")
        if not rec:
            raise P.APIError(503, f"the context server ended the prompt without a state to hand off "
                                  f"({final.finish_reason if final else 'no output'}); send the request again",
                             code="prefill_aborted")
        m = final.metrics
        rec["timing"] = {"arrival": m.arrival, "first_scheduled": m.first_scheduled, "first_token": m.first_token,
                         "exported": rec.pop("exported"), "cached_tokens": m.cached_tokens}
        return rec

    # ---- generation side -----------------------------------------------------------------------------------
    def _method(self, transport: dict) -> str:
        if self.method == "zmq":
            return "zmq"
        if self.method == "nixl" or (transport.get("nixl") and nixl_api() is not None):
            return "nixl"
        return "zmq"

    def _fetch(self, address: str, tid: str, method: str, corrupt: int, spent: dict):
        """The state, pulled and verified (a failed checksum pulled once more); `spent` adds up the seconds of
        each part (pull, verify) for the timing header."""
        last = None
        for attempt in range(2):
            t0 = time.monotonic()
            state = self.client.pull(address, tid, method)
            if attempt < corrupt and state.nbytes:           # test-only fault injection (KESTREL_DISAGG_FAULTS)
                state.buffer[state.nbytes // 2] ^= 0x10
            t1 = time.monotonic()
            try:
                verify(state)
                return state
            except HandoffError as e:
                last = e
                log.warning("handoff %s from %s: %s (attempt %d of 2)", tid, address, e, attempt + 1)
            finally:
                spent["pull_s"] = spent.get("pull_s", 0.0) + t1 - t0
                spent["verify_s"] = spent.get("verify_s", 0.0) + time.monotonic() - t1
        raise HandoffError(f"the state transfer {tid} failed its checksum twice ({last}); the request is not run "
                           "on a corrupt state: send it again")

    async def generate(self, request: Request, kind: str) -> Response:
        server, received = self.server, time.monotonic()
        try:
            prep = await server.parse_request(request, kind)
            try:
                handoff = json.loads(request.headers.get(HANDOFF_HEADER, ""))
                address, transfers = handoff["transport"]["zmq"], handoff["transfers"]
            except (ValueError, KeyError, TypeError):
                raise P.APIError(400, f"this route needs the context server's answer in the {HANDOFF_HEADER} "
                                      "header (the frontend sends it); send client requests to the frontend")
            if len(transfers) != len(prep.choices):
                raise P.APIError(400, f"the handoff has {len(transfers)} states for {len(prep.choices)} choices")
            corrupt = 0
            if self.faults:
                fault = request.headers.get(FAULT_HEADER, "")
                corrupt = int(fault.split("=", 1)[1]) if fault.startswith("flip=") else 0
            method = self._method(handoff["transport"])
            spent: dict = {}
            try:
                if not self.client.knows(address):      # after the first request: no thread hop for it
                    await self._io(self.client.handshake, address, self.layout)
                states = []
                for ch, t in zip(prep.choices, transfers):
                    if t["prompt"] != prompt_digest(ch.prompt_ids):
                        raise P.APIError(400, "the prompt encodes to other token ids here than on the context "
                                              "server; run both with the same checkpoint and chat format")
                    states.append(await self._io(self._fetch, address, t["tid"], method, corrupt, spent))
            except LayoutMismatch as e:
                raise P.APIError(409, str(e), code="layout_mismatch") from None
            except HandoffError as e:
                lost = isinstance(e, TransportError)    # the peer is gone (or dropped the state): retry elsewhere
                if not lost:                            # the peer is fine but its bytes are not: it may drop them
                    await self._ack(address, transfers)
                raise P.APIError(502, f"the request's cache state did not arrive from the context server: {e}",
                                 code=STATE_LOST if lost else "kv_transfer_failed") from None
            verified = time.monotonic()
            # the states arrived whole: the acknowledgement only frees the context server's copies, so it goes
            # out in the background instead of delaying the first token (the context server also drops an
            # unacknowledged state after --handoff-timeout)
            task = asyncio.get_running_loop().create_task(self._ack(address, transfers))
            self._acks.add(task)
            task.add_done_callback(self._acks.discard)
            for ch, t, state in zip(prep.choices, transfers, states):
                ch.params = dataclasses.replace(ch.params, seed=t["seed"])   # one seed for the whole request
                ch.on_add = (lambda engine, req, s=state, t=t:
                             admit_imported(engine, req, s, t["first_token"], t.get("logprob"),
                                            t.get("cached_tokens", 0)))
        except P.APIError as e:
            return server._error(e)
        except ClientGone:
            return Response(status_code=499)
        response = await server.respond(request, prep)
        response.headers[TIMING_HEADER] = json.dumps({"received": received, "verified": verified,
                                                      "transport": method, **spent})
        return response
