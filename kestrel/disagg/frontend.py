"""The frontend of disaggregated serving (`kestrel serve --role frontend --discovery-dir DIR`).

It loads no model. It reads the discovery directory every `poll` seconds (stale entries dropped), and answers
OpenAI's `/v1/completions` and `/v1/chat/completions`: the body goes as it is to a context server
(`/disagg/prefill/...`, round robin), whose answer (transfer ids, first tokens) goes with the body to a generation
server whose cache layout matches (`/disagg/generate/...`; one that cannot be reached is skipped, the context server
still holds the state), and the generation server's answer (JSON, or the SSE stream) is relayed to the client byte
for byte. A request the servers refuse gets their OpenAI error as it is; no server of a role, or no generation
server whose layout matches, is a 503 naming why.

Retry: a request whose context server fails before the hand-off completed (connection reset, no answer within
`prefill_timeout`, 503 while shutting down, or the generation server answering `context_state_lost`: the state
never arrived) runs once more, from its prompt, on another live context server, when one exists; then it fails
with that failure's error. A server that refuses the connection ran nothing and is not live: it is skipped without
spending the retry. Nothing was sent to the client before the hand-off, so the retry is invisible to it. A failed
server is skipped until its next heartbeat. A generation server that dies after its stream began ends
the stream with an SSE error event (`generation_server_lost`): tokens were sent, so nothing is generated again.

Clocks: the first frontend of the directory (oldest start) is the reference: it measures every server's steady-
clock offset (clocks.py) and answers `/disagg/clock-offsets`; a later frontend forwards that route to it (a peer
that is not listening yet is retried, not an error) and measures its own offset to it. Each request's TTFT split
(queue, prefill, transfer, first decode) is kept on this frontend's clock: `GET /disagg/timings`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections import deque

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kestrel.disagg import clocks
from kestrel.disagg.discovery import Entry, read_entries
from kestrel.disagg.handshake import first_difference
from kestrel.disagg.worker import FAULT_HEADER, HANDOFF_HEADER, STATE_LOST, TIMING_HEADER
from kestrel.serve import protocol as P
from kestrel.serve.security import check_bearer

log = logging.getLogger("kestrel.disagg")

ROUTES = {"/v1/completions": "v1/completions", "/v1/chat/completions": "v1/chat/completions"}
CONTEXT_TRIES = 2       # a request's first context server, and one more when that one fails before the hand-off


def _error(status: int, message: str, code: str, type_: str = "server_error") -> JSONResponse:
    return JSONResponse(P.error_body(message, type_, None, code), status_code=status)


class _StateLost(Exception):
    """The generation server reported that the request's state never arrived from its context server."""

    def __init__(self, message: str, response: Response):
        super().__init__(message)
        self.response = response


class Frontend:
    def __init__(self, directory: str, url: str = "", api_keys: tuple[str, ...] = (), poll: float = 0.5,
                 stale_after: float = 5.0, connect_timeout: float = 5.0, max_request_bytes: int = 16 << 20,
                 hosts=None, prefill_timeout: float = 600.0):
        self.directory, self.url, self.poll, self.stale_after = directory, url, poll, stale_after
        # a context server answers once the prompt has run: past this, it counts as dead and the request is retried
        self.prefill_timeout = httpx.Timeout(prefill_timeout, connect=connect_timeout)
        self.hosts = hosts                  # serve.security.HostCheck, or None: any Host header
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.max_request_bytes = max_request_bytes
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=connect_timeout),
                                        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        self.entries: list[Entry] = []
        self.down: dict[str, float] = {}           # url -> heartbeat seen when it failed (skipped until a newer one)
        self.offsets: dict[str, clocks.Offset] = {}
        self.seed_offset: clocks.Offset | None = None  # the first frontend's clock - ours (secondary frontends)
        self.timings: deque[dict] = deque(maxlen=4096)
        self._rr = {"context": itertools.count(), "generation": itertools.count()}
        self._task: asyncio.Task | None = None
        self.app = self._build_app()

    # ---- discovery -----------------------------------------------------------------------------------------
    def live(self, role: str) -> list[Entry]:
        return [e for e in self.entries if e.role == role and self.down.get(e.url, -1.0) < e.heartbeat]

    def seed(self) -> Entry | None:
        fronts = [e for e in self.entries if e.role == "frontend"]
        return fronts[0] if fronts else None

    def is_seed(self) -> bool:
        s = self.seed()
        return s is None or s.url == self.url

    async def refresh(self) -> None:
        self.entries = await asyncio.to_thread(read_entries, self.directory, self.stale_after)
        if self.is_seed():
            for e in self.entries:
                if e.role in ("context", "generation") and e.url not in self.offsets:
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                        self.offsets[e.url] = await clocks.measure(self.client, e.url)
        else:
            await self._offsets_from_seed()

    async def _offsets_from_seed(self) -> None:
        seed = self.seed()
        try:
            if self.seed_offset is None:
                self.seed_offset = await clocks.measure(self.client, seed.url)
            r = await self.client.get(f"{seed.url}/disagg/clock-offsets")
            for url, o in r.json().items():     # server - seed + seed - us = server - us
                self.offsets[url] = clocks.Offset(o["offset"] + self.seed_offset.offset,
                                                  o["rtt"] + self.seed_offset.rtt, time.monotonic())
        except (httpx.ConnectError, httpx.ConnectTimeout):
            pass                # the first frontend is published but not listening yet: the next poll retries
        except (httpx.HTTPError, ValueError, KeyError, AttributeError) as e:
            log.warning("clock offsets from the first frontend %s: %s", seed.url, e)

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:       # a bad poll must not end discovery
                log.exception("discovery poll failed")
            await asyncio.sleep(self.poll)

    def pairs(self) -> tuple[list[tuple[Entry, Entry]], list[str]]:
        """(context, generation) pairs whose layouts match, context servers in round-robin order; and the reason
        of each pair that does not match."""
        cs, gs = self.live("context"), self.live("generation")
        if cs:
            k = next(self._rr["context"]) % len(cs)
            cs = cs[k:] + cs[:k]
        if gs:
            k = next(self._rr["generation"]) % len(gs)
            gs = gs[k:] + gs[:k]
        good, bad = [], []
        for c in cs:
            for g in gs:
                why = first_difference(c.cache_layout, g.cache_layout)
                if why is None:
                    good.append((c, g))
                else:
                    bad.append(f"{c.url} / {g.url}: {why}")
        return good, bad

    # ---- the app -------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            await self.refresh()
            self._task = asyncio.get_running_loop().create_task(self._poll())
            try:
                yield
            finally:
                self._task.cancel()
                await self.client.aclose()

        app = FastAPI(title="Kestrel frontend", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

        @app.middleware("http")
        async def keys(request: Request, call_next):
            if self.hosts is not None:      # DNS rebinding, as on the model servers
                why = self.hosts.refuse([v for k, v in request.headers.raw if k == b"host"])
                if why is not None:
                    return _error(400, why, "invalid_host", "invalid_request_error")
            if self.api_keys and request.url.path not in ("/health", "/disagg/clock", "/disagg/clock-offsets"):
                why = check_bearer(request.headers.get("authorization", "").encode() or None, self.api_keys)
                if why is not None:
                    return _error(401, why, "invalid_api_key", "invalid_request_error")
            return await call_next(request)

        @app.get("/health")
        async def health():
            return {"status": "ok", "context": len(self.live("context")),
                    "generation": len(self.live("generation"))}

        @app.get("/disagg/clock")
        async def clock():
            return {"monotonic": time.monotonic(), "wall": time.time()}

        @app.get("/disagg/clock-offsets")
        async def clock_offsets():
            if self.is_seed():
                return {u: {"offset": o.offset, "rtt": o.rtt} for u, o in self.offsets.items()}
            return await self._forward_to_seed("/disagg/clock-offsets")

        @app.get("/disagg/servers")
        async def servers():
            good, bad = self.pairs()
            return {"servers": [e.to_dict() for e in self.entries], "down": sorted(self.down),
                    "pairs": [[c.url, g.url] for c, g in good], "mismatched": bad, "seed": self.is_seed()}

        @app.get("/disagg/timings")
        async def timings():
            return list(self.timings)

        @app.get("/v1/models")
        async def models(request: Request):
            for e in self.live("context") + self.live("generation"):
                try:
                    r = await self.client.get(f"{e.url}/v1/models", headers=self._headers(request))
                    return Response(r.content, r.status_code, media_type="application/json")
                except httpx.HTTPError:
                    continue
            return _error(503, "no context or generation server is up; start one with `kestrel serve --role "
                               "context|generation --discovery-dir DIR`", "no_server")

        for path, route in ROUTES.items():
            app.add_api_route(path, self._route(route), methods=["POST"])
        return app

    def _route(self, route: str):
        async def handle(request: Request):
            return await self.handle(request, route)
        return handle

    async def _forward_to_seed(self, path: str, tries: int = 20) -> Response:
        for i in range(tries):
            seed = self.seed()
            try:
                r = await self.client.get(f"{seed.url}{path}")
                return Response(r.content, r.status_code, media_type="application/json")
            except (httpx.ConnectError, httpx.ConnectTimeout):     # not listening yet: wait and retry
                await asyncio.sleep(min(0.05 * 2 ** i, 1.0))
                await self.refresh()
        return _error(503, f"the first frontend {self.seed().url} did not answer {path}", "seed_unreachable")

    def _headers(self, request: Request) -> dict:
        out = {"content-type": request.headers.get("content-type", "application/json")}
        for name in ("authorization", FAULT_HEADER):
            if name in request.headers:
                out[name] = request.headers[name]
        return out

    def _mark_down(self, e: Entry, why: Exception | str) -> None:
        self.down[e.url] = e.heartbeat
        log.warning("%s server %s did not answer (%s); skipping it until its next heartbeat", e.role, e.url,
                    why if isinstance(why, str) else type(why).__name__)

    # ---- requests ------------------------------------------------------------------------------------------
    async def handle(self, request: Request, route: str) -> Response:
        received = time.monotonic()
        body = await request.body()
        if len(body) > self.max_request_bytes:
            return _error(413, f"the request body is larger than {self.max_request_bytes} bytes", "request_too_large",
                          "invalid_request_error")
        headers = self._headers(request)
        good, bad = self.pairs()
        if not good:
            if bad:
                return _error(503, "no generation server has a cache layout that matches a context server's: "
                                   + bad[0], "layout_mismatch")
            missing = "context" if not self.live("context") else "generation"
            return _error(503, f"no {missing} server is up; start one with `kestrel serve --role {missing} "
                               f"--discovery-dir {self.directory}`", "no_server")
        tried: list[str] = []
        ran = 0                 # context servers that received the request (a refused connection ran nothing)
        failure: Response | None = None
        for c, _ in good:
            if c.url in tried or self.down.get(c.url, -1.0) >= c.heartbeat:
                continue
            if ran == CONTEXT_TRIES:
                break
            if ran:
                log.warning("request retried from its prompt on context server %s", c.url)
                headers = {k: v for k, v in headers.items() if k != FAULT_HEADER}   # a test's fault: first try only
            tried.append(c.url)
            try:
                r = await self.client.post(f"{c.url}/disagg/prefill/{route}", content=body, headers=headers,
                                           timeout=self.prefill_timeout)
                if r.status_code == 200:
                    handoff = r.json()
            except (httpx.HTTPError, ValueError) as e:   # refused, reset, no answer in time: nothing was handed off
                self._mark_down(c, e)
                ran += not isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))
                failure = _error(503, f"the context server {c.url} failed before it handed the request off "
                                      f"({type(e).__name__}); send the request again later", "context_server_lost")
                continue
            ran += 1
            if r.status_code == 503:         # shutting down: another context server may take it
                self._mark_down(c, "503-shutting-down")
                failure = Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
                continue
            if r.status_code != 200:         # the request itself was refused: the client gets the reason
                return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
            gens = [g for cc, g in good if cc.url == c.url]
            try:
                return await self._generate(request, route, body, headers, c, gens, handoff, received)
            except _StateLost as e:
                self._mark_down(c, "its-state-never-arrived")
                log.warning("the state of a request on context server %s did not arrive: %s", c.url, e)
                failure = e.response
        if failure is not None:
            return failure
        return _error(503, "no context server answered (tried " + ", ".join(tried) + "); send the request again "
                           "later", "no_server")

    async def _generate(self, request, route, body, headers, c: Entry, gens: list[Entry], handoff: dict,
                        received: float) -> Response:
        head = dict(headers)
        head[HANDOFF_HEADER] = json.dumps({"transport": handoff["transport"], "transfers": [
            {k: v for k, v in t.items() if k != "timing"} for t in handoff["transfers"]]})
        for g in gens:
            req = self.client.build_request("POST", f"{g.url}/disagg/generate/{route}", content=body, headers=head)
            try:
                resp = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                self._mark_down(g, e)
                continue
            record = {"context": c.url, "generation": g.url, "received": received}
            ctype = resp.headers.get("content-type", "application/json")
            if not ctype.startswith("text/event-stream"):
                try:
                    content = await resp.aread()
                except httpx.HTTPError as e:
                    self._mark_down(g, e)
                    return _error(502, f"the generation server {g.url} went away before it answered ({e}); send the "
                                       "request again", "generation_server_lost")
                finally:
                    await resp.aclose()
                out = Response(content, resp.status_code, media_type=ctype)
                if resp.status_code == 502:     # the state never arrived: the caller may retry the prompt elsewhere
                    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                        err = json.loads(content)["error"]
                        if err.get("code") == STATE_LOST:
                            raise _StateLost(f"generation server {g.url}: {err.get('message')}", out)
                self._record(record, handoff, resp, time.monotonic())
                return out
            return StreamingResponse(self._relay(resp, g, record, handoff), resp.status_code, media_type=ctype,
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return _error(503, f"no generation server answered for context server {c.url}; send the request again",
                      "no_server")

    async def _relay(self, resp: httpx.Response, g: Entry, record: dict, handoff: dict):
        first = True
        try:
            async for chunk in resp.aiter_raw():
                if first and b"data:" in chunk:
                    self._record(record, handoff, resp, time.monotonic())
                    first = False
                yield chunk
        except httpx.HTTPError as e:
            self._mark_down(g, e)
            yield P.sse(P.error_body(f"the generation server {g.url} went away mid-stream ({type(e).__name__}); "
                                     "the output stops here: send the request again", "server_error", None,
                                     "generation_server_lost"))
            yield P.SSE_DONE
        finally:
            await resp.aclose()

    def _record(self, record: dict, handoff: dict, resp: httpx.Response, first_byte: float) -> None:
        try:
            g_timing = json.loads(resp.headers.get(TIMING_HEADER, "{}"))
            c_timing = handoff["transfers"][0]["timing"]
        except (ValueError, KeyError, IndexError):
            return
        split = clocks.ttft_split(c_timing, g_timing, self.offsets.get(record["context"]),
                                  self.offsets.get(record["generation"]), record["received"], first_byte)
        self.timings.append({**record, **split, "transport": g_timing.get("transport"),
                             "cached_tokens": c_timing.get("cached_tokens"),
                             "nbytes": sum(t.get("nbytes", 0) for t in handoff["transfers"])})
