"""The OpenAI-compatible HTTP API over one `Engine`.

Routes: POST /v1/completions, POST /v1/chat/completions (the server's `ChatFormat`: the checkpoint's chat template
or the Kimi family's encoding, tools, structured output, reasoning), GET /v1/models, GET /health, GET /metrics
(Prometheus text). Streaming answers are server-sent events ending with `data: [DONE]`.

Each choice of a request (n choices per prompt) is one engine request, driven by its own asyncio task that
iterates `AsyncEngine.generate`. The HTTP handler only merges those tasks' outputs; when the handler ends for any
reason (finished, error, client disconnected, server shutdown) it cancels the tasks that are still running, and
a cancelled task's `generate` iterator aborts its engine request, which returns the request's pages and state slot.
Running the choices in tasks of their own keeps that abort out of the HTTP framework's cancellation scopes.

Before a request reaches a route, `_Middleware` checks the `Host` header (DNS rebinding) and the API key. A route
checks the content type, reads the body under the size limit and the body timeout, and validates every field
(`protocol.py`) before any stream starts; after a stream has started, a failure ends it with an SSE error event.
At shutdown (`lifecycle.py`) the requests still running after the grace period are aborted through
`AsyncEngine.abort` and answered with a 503 error (JSON, or an SSE error event).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kestrel.errors import KestrelError
from kestrel.runtime.engine import AsyncEngine, Engine, RequestOutput
from kestrel.sampling_params import SamplingParams
from kestrel.serve import protocol as P
from kestrel.serve import schema as S
from kestrel.serve.chat.output import ChatOutputParser
from kestrel.serve.chat_format import ChatFormat
from kestrel.serve.metrics import ServerMetrics
from kestrel.serve.security import HostCheck, check_bearer

log = logging.getLogger("kestrel.serve")

ROUTES = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics, "
          "GET /openapi.json")


class _JSON(JSONResponse):
    """JSON that never fails to encode (a lone surrogate becomes an escape instead of a 500)."""

    def render(self, content) -> bytes:
        return P.dumps(content).encode("utf-8")


class ClientGone(Exception):
    """The client went away before its request body arrived."""


@dataclass(eq=False)
class _Choice:
    """One engine request of an HTTP request."""
    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    num_logprobs: int | None
    echo_text: str = ""
    task: asyncio.Task | None = None
    final: RequestOutput | None = None
    first_token_at: float | None = None
    logprobs_sent: int = 0          # logprob entries already streamed
    text_len: int = 0               # characters already streamed (text_offset of completions logprobs)
    error: P.APIError | None = None
    grammar: object = None          # the choice's own grammar matcher (constrained decoding), or None
    parser: ChatOutputParser | None = None      # chat with tool / reasoning parsing; None: plain text
    on_add: object = None           # AsyncEngine.generate's hook (disaggregated serving: import the state)


@dataclass(eq=False)
class _Prepared:
    """A validated request: its choices and the per-prompt token counts (for usage)."""
    kind: str                        # "completion" | "chat"
    request: P.GenerationRequest
    choices: list[_Choice]
    prompt_lens: list[int]
    received: float
    id: str = field(default_factory=lambda: P.new_id("cmpl"))
    created: int = field(default_factory=P.now)
    started: bool = False
    closed: bool = False
    stream_done: bool = False        # the stream sent its last event (a disconnect leaves it False)


class OpenAIServer:
    def __init__(self, engine: Engine, served_model_name: str | None = None, api_keys: tuple[str, ...] = (),
                 limits: P.Limits = P.Limits(), hosts: HostCheck | None = None, body_timeout: float = 30.0,
                 chat: ChatFormat | None = None):
        self.engine = engine
        self.async_engine = AsyncEngine(engine)
        self.tokenizer = engine.tokenizer
        if chat is None and self.tokenizer is not None:
            chat = ChatFormat(self.tokenizer, engine.config.vocab_size, engine.eos_ids)
        self.chat = chat                    # None: no tokenizer, so no chat
        # the name clients use; never the checkpoint's path on disk
        self.model_name = served_model_name or os.path.basename(os.path.normpath(engine.engine_config.model))
        self.api_keys = tuple(k.encode("utf-8") for k in api_keys)      # empty: no key required
        self.limits = limits
        self.hosts = hosts                  # None: any Host header
        self.body_timeout = body_timeout
        self.draining = False               # set at shutdown: new requests are refused
        self.aborting = False               # set when the grace period is over: nothing new may start
        self._in_flight: set[_Prepared] = set()
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.config.vocab_size
        cache = engine.cache
        self.capacity = min(cache.num_pages, getattr(cache, "max_pages_per_seq", cache.num_pages)) * cache.page_size
        self.metrics = ServerMetrics(self.model_name)
        self.created = P.now()
        self._tasks: set[asyncio.Task] = set()
        self.app = self._build_app()

    # ---- the app -------------------------------------------------------------------------------------------
    def _build_app(self) -> "_Middleware":
        app = FastAPI(title="Kestrel", docs_url=None, redoc_url=None, openapi_url=None,
                      default_response_class=_JSON)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException):
            if exc.status_code == 404:
                msg = f"there is no route {request.method} {request.url.path}; this server answers {ROUTES}"
            elif exc.status_code == 405:
                msg = f"{request.method} is not allowed on {request.url.path}; this server answers {ROUTES}"
            else:
                msg = str(exc.detail)
            return _JSON(P.error_body(msg, "invalid_request_error"), status_code=exc.status_code,
                         headers=getattr(exc, "headers", None))

        @app.exception_handler(Exception)
        async def _internal(request: Request, exc: Exception):
            log.exception("internal error answering %s %s", request.method, request.url.path)
            return _JSON(P.error_body(f"internal server error ({type(exc).__name__}); the server's log has the "
                                      "details", "server_error"), status_code=500)

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi():
            return self.openapi()

        @app.get("/health")
        async def health():
            if self.draining:
                return _JSON({"status": "shutting down"}, status_code=503)
            dead = self._engine_failed()
            if dead is not None:
                return _JSON({"status": "error", "error": f"the engine loop stopped: {dead!r}"}, status_code=503)
            body = {"status": "ok"}
            last = getattr(self.async_engine, "error", None)
            if last is not None:
                body["last_engine_error"] = repr(last)
            return body

        @app.get("/v1/models", **S.route("models"))
        async def models():
            return {"object": "list", "data": [self.model_card()]}

        @app.get("/v1/models/{name:path}", **S.route("model"))
        async def model(name: str):
            if name != self.model_name:
                return self._error(self._unknown_model(name))
            return self.model_card()

        @app.get("/metrics", **S.route("metrics"))
        async def metrics():
            text = self.metrics.render(self.engine.stats(), self.engine.cache.num_pages, self.engine.cache.num_slots)
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.post("/v1/completions", **S.route("completions"))
        async def completions(request: Request):
            return await self._handle(request, "completion")

        @app.post("/v1/chat/completions", **S.route("chat"))
        async def chat_completions(request: Request):
            return await self._handle(request, "chat")

        self._fastapi = app
        self._openapi: dict | None = None
        return _Middleware(app, self)

    def openapi(self) -> dict:
        if self._openapi is None:
            self._openapi = S.openapi(self._fastapi, self.limits)
        return self._openapi

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kestrel",
                "root": self.model_name, "max_model_len": self.max_model_len, "vocab_size": self.vocab_size}

    def _unknown_model(self, name: str) -> P.APIError:
        return P.APIError(404, f"the model {P.show(name)} does not exist; this server serves `{self.model_name}`",
                          param="model", code="model_not_found")

    def _error(self, e: P.APIError) -> JSONResponse:
        return _JSON(e.body(), status_code=e.status)

    # ---- request handling ----------------------------------------------------------------------------------
    async def _handle(self, request: Request, kind: str) -> Response:
        try:
            prep = await self.parse_request(request, kind)
        except P.APIError as e:
            return self._error(e)
        except ClientGone:
            log.info("client of %s %s disconnected before its request body arrived", request.method,
                     request.url.path)
            return Response(status_code=499)
        return await self.respond(request, prep)

    async def parse_request(self, request: Request, kind: str) -> _Prepared:
        """Read and validate a request into its choices (raises APIError, or ClientGone); nothing runs yet."""
        received = time.monotonic()
        _check_json_type(request.headers.getlist("content-type"))
        body = P.parse_json(await self._read_body(request))
        req = P.parse_completion(body, self.limits) if kind == "completion" else P.parse_chat(body, self.limits)
        if req.model is not None and req.model != self.model_name:
            raise self._unknown_model(req.model)
        prep = await self._prepare(kind, req, received)
        if self.aborting:       # validated while the server was aborting what was left: it cannot run now
            raise P.APIError(503, "the server is shutting down; send the request to another server or later",
                             code="server_shutdown")
        return prep

    async def respond(self, request: Request, prep: _Prepared) -> Response:
        """Run a parsed request's choices and answer: an SSE stream or one JSON body."""
        if prep.request.stream:
            return _Stream(self._stream(prep), cleanup=lambda: self._stream_closed(prep))
        return await self._complete(request, prep)

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) past `max_request_bytes` and (408) when it takes longer than `body_timeout`."""
        limit = self.limits.max_request_bytes
        too_big = P.APIError(413, f"the request body is larger than this server accepts (max_request_bytes = "
                                  f"{limit}, `kestrel serve --max-request-bytes`); send a smaller request",
                             code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            raise P.APIError(408, f"the request body did not arrive within {self.body_timeout:g} s "
                                  "(`kestrel serve --body-timeout`); send it faster", code="timeout") from None
        except ClientDisconnect:
            raise ClientGone from None
        return b"".join(chunks)

    async def _prepare(self, kind: str, req: P.GenerationRequest, received: float) -> _Prepared:
        tok = self.tokenizer
        prompts: list[tuple[list[int], str, str]] = []     # (ids, echo text, param name)
        if kind == "completion":
            for i, p in enumerate(req.prompts):
                param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
                if isinstance(p, str):
                    if tok is None:
                        raise P.bad(param, "is text but this checkpoint has no tokenizer; send token ids")
                    ids = await self._encode(p)
                    if not ids:
                        raise P.bad(param, "encodes to no tokens; give at least one token")
                    echo = p
                else:
                    ids = p
                    echo = tok.decode(ids) if (req.echo and tok is not None) else ""
                prompts.append((ids, echo if req.echo else "", param))
        else:
            if self.chat is None:
                raise P.APIError(400, "this checkpoint has no tokenizer, so no chat; use /v1/completions",
                                 param="messages")
            try:
                ids, chat_prompt = await self._encode_chat(req)
                self.chat.check(req.tools)
            except KestrelError as e:
                raise P.APIError(400, str(e), param=getattr(e, "param", "messages")) from None
            prompts.append((ids, "", "messages"))

        for ids, _, param in prompts:
            bad_ids = [t for t in ids if t >= self.vocab_size]
            if bad_ids:
                raise P.bad(param, f"contains the token id {bad_ids[0]}, outside the vocabulary "
                                   f"(0..{self.vocab_size - 1})")
            if len(ids) >= self.max_model_len:
                raise P.APIError(400, f"`{param}` has {len(ids)} tokens but this model's maximum context length is "
                                      f"{self.max_model_len} tokens (prompt plus at least one generated token); "
                                      "shorten the prompt", param=param, code="context_length_exceeded")
            if len(ids) + 1 > self.capacity:
                raise P.APIError(400, f"`{param}` has {len(ids)} tokens but one request's KV cache can hold at "
                                      f"most {self.capacity} tokens on this server; shorten the prompt", param=param,
                                 code="context_length_exceeded")
            if req.max_tokens is not None and len(ids) + req.max_tokens > self.max_model_len:
                mt = req.max_tokens_param
                raise P.APIError(400, f"`{mt}` = {req.max_tokens} is out of range: the prompt has {len(ids)} "
                                      f"tokens and this model's maximum context length is {self.max_model_len}, so "
                                      f"at most {self.max_model_len - len(ids)} tokens can be generated",
                                 param=mt, code="context_length_exceeded")
        bad_stop = [t for t in req.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise P.bad("stop_token_ids", f"contains the token id {bad_stop[0]}, outside the vocabulary "
                                          f"(0..{self.vocab_size - 1})")

        num_choices = len(prompts) * req.n
        budget = self.limits.max_request_tokens
        share = budget // num_choices
        if req.max_tokens is not None and req.max_tokens * num_choices > budget:
            mt = req.max_tokens_param
            raise P.APIError(400, f"`{mt}` = {req.max_tokens} for {num_choices} choice(s) asks for "
                                  f"{req.max_tokens * num_choices} tokens; this server generates at most "
                                  f"max_request_tokens = {budget} tokens per request (`kestrel serve "
                                  "--max-request-tokens`); ask for fewer tokens or fewer choices", param=mt,
                             code="request_too_large")
        if share < 1:
            raise P.APIError(400, f"{num_choices} choices are more than the {budget} tokens this server generates per "
                                  "request (max_request_tokens) allow; ask for fewer choices", param="n",
                             code="request_too_large")

        prep = _Prepared(kind, req, [], [len(ids) for ids, _, _ in prompts], received,
                         id=P.new_id("cmpl" if kind == "completion" else "chatcmpl"))
        for pi, (ids, echo, _) in enumerate(prompts):
            max_tokens = req.max_tokens
            if max_tokens is None:      # completions: OpenAI's 16; chat: the rest of the context; both in budget
                max_tokens = min(16 if kind == "completion" else self.max_model_len - len(ids), share)
            for i in range(req.n):
                try:
                    params = SamplingParams(
                        max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                        min_p=req.min_p, seed=None if req.seed is None else req.seed + i, stop=list(req.stop),
                        stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos,
                        logprobs=req.num_logprobs)
                except KestrelError as e:
                    msg = str(e)
                    raise P.APIError(400, msg, param=msg.split(" ", 1)[0]) from None
                index = pi * req.n + i
                ch = _Choice(index, pi, ids, params, f"{prep.id}-{index}", req.num_logprobs, echo_text=echo)
                if kind == "chat":
                    try:
                        ch.grammar = self.chat.grammar(req.tools, chat_prompt)
                    except KestrelError as e:
                        raise P.APIError(400, str(e), param=getattr(e, "param", None)) from None
                    ch.parser = self.chat.parser(req.tools, chat_prompt)
                prep.choices.append(ch)
        return prep

    async def _encode(self, text: str) -> list[int]:
        """Token ids of request text (always plain text: it never becomes special tokens); a long text is
        encoded in a worker thread so the event loop keeps serving."""
        if len(text) < 16384:
            return self.tokenizer.encode(text)
        return await asyncio.to_thread(self.tokenizer.encode, text)

    async def _encode_chat(self, req: P.ChatRequest):
        """The chat format's ids (its own markup as control tokens, the request's strings as plain text) and the
        prompt's facts; a long conversation is encoded in a worker thread."""
        if sum(len(m["content"]) for m in req.messages) < 16384:
            return self.chat.encode(req)
        return await asyncio.to_thread(self.chat.encode, req)

    # ---- choices -------------------------------------------------------------------------------------------
    def _start(self, prep: _Prepared, sink: asyncio.Queue | None) -> None:
        loop = asyncio.get_running_loop()
        for ch in prep.choices:
            ch.task = loop.create_task(self._drive(ch, sink, prep.received))
            self._tasks.add(ch.task)
            ch.task.add_done_callback(self._tasks.discard)
        prep.started = True
        self._in_flight.add(prep)
        self.metrics.in_flight += 1

    def _cancel(self, prep: _Prepared) -> None:
        """The HTTP side is done with this request: stop every choice still generating (idempotent)."""
        if prep.closed:
            return
        prep.closed = True
        self._in_flight.discard(prep)
        if prep.started:
            self.metrics.in_flight -= 1
        for ch in prep.choices:
            if ch.task is not None and not ch.task.done():
                ch.task.cancel()

    async def _drive(self, ch: _Choice, sink: asyncio.Queue | None, received: float) -> RequestOutput | None:
        """Iterate one engine request, forwarding its outputs to `sink` (streaming). Ends with the final output,
        or with `ch.error` set (and `(ch, None)` put in the sink) when the request failed."""
        out: RequestOutput | None = None
        finished = False
        try:
            async for out in self.async_engine.generate(ch.prompt_ids, ch.params, ch.request_id, ch.grammar,
                                                        on_add=ch.on_add):
                if ch.first_token_at is None and out.delta_token_ids:
                    ch.first_token_at = time.monotonic()
                if sink is not None:
                    sink.put_nowait((ch, out))
            ch.final = out
            finished = out is not None and out.finished and ch.error is None
            if not finished and ch.error is None:
                ch.error = P.APIError(500, "the engine ended the request without a final output")
            return out if finished else None
        except KestrelError as e:       # the engine refused the request (validated here first, so rare)
            ch.error = P.APIError(400, str(e))
        except Exception as e:          # a failed engine step fails the requests it held (AsyncEngine logs it)
            ch.error = P.APIError(500, f"the engine failed while running this request: {type(e).__name__}: {e}")
        finally:
            reason = out.finish_reason if finished else "abort"
            self.metrics.observe_request(received, ch.first_token_at, time.monotonic(), len(ch.prompt_ids),
                                         len(out.token_ids) if out is not None else 0, reason)
            if sink is not None and not finished:
                sink.put_nowait((ch, None))
        return None

    # ---- non-streaming -------------------------------------------------------------------------------------
    async def _complete(self, request: Request, prep: _Prepared) -> Response:
        self._start(prep, None)
        gathered = asyncio.gather(*(ch.task for ch in prep.choices), return_exceptions=True)
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if gathered not in done:
                log.info("client of %s disconnected; aborted its %d engine request(s)", prep.id, len(prep.choices))
                return Response(status_code=499)
            errors = [ch.error for ch in prep.choices if ch.error is not None]
            if errors:              # a shutdown abort wins: it says why the other choices stopped
                return self._error(next((e for e in errors if e.status == 503), errors[0]))
            for r in gathered.result():
                if isinstance(r, BaseException):
                    raise r
            return _JSON(self._full_response(prep))
        finally:
            watcher.cancel()
            self._cancel(prep)          # cancels the choices still running; the gather then ends by itself
            gathered.add_done_callback(_consume)

    def _full_response(self, prep: _Prepared) -> dict:
        req = prep.request
        choices = []
        for ch in prep.choices:
            out = ch.final
            lp_entries = list(zip(out.token_ids, out.logprobs)) if ch.num_logprobs is not None else None
            if prep.kind == "completion":
                choices.append({"index": ch.index, "text": ch.echo_text + out.text,
                                "logprobs": None if lp_entries is None else
                                P.completion_logprobs(self._lp_text(lp_entries, ch.num_logprobs), len(ch.echo_text)),
                                "finish_reason": out.finish_reason, "stop_reason": None})
            else:
                message, finish = {"role": "assistant", "content": out.text}, out.finish_reason
                if ch.parser is not None:       # parsed from the ids: the model's markup is not text
                    ch.parser.feed_ids(out.token_ids)
                    ch.parser.finish()
                    message, finish = ch.parser.message(), ch.parser.finish_reason(out.finish_reason)
                    message["content"] = _cut_at_stop(message["content"], req.stop)
                choices.append({"index": ch.index, "message": message,
                                "logprobs": None if lp_entries is None else
                                P.chat_logprobs(self._lp_bytes(lp_entries, ch.num_logprobs)),
                                "finish_reason": finish})
            if req.return_token_ids:
                choices[-1]["token_ids"] = list(out.token_ids)
                choices[-1]["prompt_token_ids"] = list(ch.prompt_ids)
        return {"id": prep.id, "object": "text_completion" if prep.kind == "completion" else "chat.completion",
                "created": prep.created, "model": self.model_name, "choices": choices,
                "usage": self._usage(prep)}

    def _usage(self, prep: _Prepared) -> dict:
        completion = sum(len(ch.final.token_ids) for ch in prep.choices if ch.final is not None)
        cached = 0
        for pi in range(len(prep.prompt_lens)):
            first = next((ch for ch in prep.choices if ch.prompt_index == pi and ch.final is not None), None)
            m = getattr(first.final, "metrics", None) if first is not None else None
            cached += getattr(m, "cached_tokens", 0) or 0
        return P.usage(sum(prep.prompt_lens), completion, cached)

    # ---- streaming -----------------------------------------------------------------------------------------
    async def _stream(self, prep: _Prepared):
        req = prep.request
        sink: asyncio.Queue = asyncio.Queue()
        obj = "text_completion" if prep.kind == "completion" else "chat.completion.chunk"
        usage_null = {"usage": None} if req.include_usage else {}

        def chunk(choice: dict) -> str:
            return P.sse({"id": prep.id, "object": obj, "created": prep.created, "model": self.model_name,
                          "choices": [choice], **usage_null})

        self._start(prep, sink)
        try:
            for ch in prep.choices:         # a first chunk per choice: the chat role, or the echoed prompt
                if prep.kind == "chat":
                    yield chunk({"index": ch.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
                elif ch.echo_text:
                    ch.text_len = len(ch.echo_text)
                    yield chunk({"index": ch.index, "text": ch.echo_text, "logprobs": None, "finish_reason": None})
            pending = len(prep.choices)
            while pending:
                ch, out = await sink.get()
                if ch.error is not None:             # the choice failed or was aborted at shutdown
                    yield P.sse(ch.error.body())
                    break
                if out is None:
                    pending -= 1
                    continue
                if out.finished:
                    pending -= 1
                if not (out.delta_text or out.delta_token_ids or out.finished):
                    continue
                for choice in self._delta_choices(prep, ch, out):
                    yield chunk(choice)
            else:
                if req.include_usage:
                    yield P.sse({"id": prep.id, "object": obj, "created": prep.created, "model": self.model_name,
                                 "choices": [], "usage": self._usage(prep)})
        except Exception as e:      # a bug while streaming: the client still gets an error event, not a cut
            log.exception("internal error while streaming %s", prep.id)
            yield P.sse(P.error_body(f"internal server error ({type(e).__name__}); the server's log has the "
                                     "details", "server_error"))
        prep.stream_done = True
        yield P.SSE_DONE

    def _stream_closed(self, prep: _Prepared) -> None:
        if not prep.stream_done and not prep.closed:
            log.info("client of %s disconnected mid-stream; aborted its %d engine request(s)", prep.id,
                     sum(ch.final is None for ch in prep.choices))
        self._cancel(prep)

    # ---- shutdown ------------------------------------------------------------------------------------------
    async def abort_in_flight(self, grace: float) -> int:
        """End every request still running (the shutdown grace period is over): each gets a 503 error, as JSON
        or as an SSE error event, and one log line. Returns how many requests were aborted."""
        self.aborting = True
        preps = [p for p in self._in_flight if not p.closed]
        for prep in preps:
            err = P.APIError(503, f"the server shut down before this request finished (it waited {grace:g} s); "
                                  "send the request again to another server or later", code="server_shutdown")
            running = [ch for ch in prep.choices if ch.final is None and ch.error is None]
            for ch in running:
                ch.error = err
                await self.async_engine.abort(ch.request_id)
            log.warning("shutdown: aborted %s (%s, %d of %d choice(s) still running)", prep.id,
                        "streaming" if prep.request.stream else "non-streaming", len(running), len(prep.choices))
        for prep in preps:       # choices that had not reached the engine yet end by cancellation
            for ch in prep.choices:
                if ch.task is not None and not ch.task.done() and ch.error is not None:
                    ch.task.cancel()
        return len(preps)

    def _delta_choices(self, prep: _Prepared, ch: _Choice, out: RequestOutput) -> list[dict]:
        """The stream choices of one engine output: one, or (chat with a parser) one per parsed delta, the
        logprobs and token ids on the first and the finish reason on the last (none when nothing is to be
        said yet)."""
        if ch.parser is None:
            return [self._delta_choice(prep, ch, out)]
        deltas = ch.parser.feed_ids(out.delta_token_ids)
        if out.finished:
            deltas += ch.parser.finish()
        extras = ch.num_logprobs is not None or prep.request.return_token_ids
        if not deltas and (out.finished or extras):
            deltas = [{}]
        choices = []
        for k, delta in enumerate(deltas):
            if k == 0:
                first = self._delta_choice(prep, ch, out)
                choices.append({**first, "delta": delta, "finish_reason": None})
            else:
                choices.append({"index": ch.index, "delta": delta, "logprobs": None, "finish_reason": None,
                                **({"token_ids": []} if prep.request.return_token_ids else {})})
        if out.finished and choices:
            choices[-1]["finish_reason"] = ch.parser.finish_reason(out.finish_reason)
        return choices

    def _delta_choice(self, prep: _Prepared, ch: _Choice, out: RequestOutput) -> dict:
        lp = None
        if ch.num_logprobs is not None:
            n = len(out.logprobs)
            entries = list(zip(out.token_ids[ch.logprobs_sent:n], out.logprobs[ch.logprobs_sent:n]))
            ch.logprobs_sent = n
            if prep.kind == "completion":
                lp = P.completion_logprobs(self._lp_text(entries, ch.num_logprobs), ch.text_len)
            else:
                lp = P.chat_logprobs(self._lp_bytes(entries, ch.num_logprobs))
        ch.text_len += len(out.delta_text)
        finish = out.finish_reason if out.finished else None
        if prep.kind == "completion":
            choice = {"index": ch.index, "text": out.delta_text, "logprobs": lp, "finish_reason": finish,
                      "stop_reason": None}
        else:
            delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
            choice = {"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if prep.request.return_token_ids:
            choice["token_ids"] = list(out.delta_token_ids)
        return choice

    # ---- logprobs ------------------------------------------------------------------------------------------
    def _piece(self, tid: int) -> tuple[str, bytes]:
        if self.tokenizer is None:
            return f"token_id:{tid}", b""
        raw = self.tokenizer.id_to_piece(tid)
        return raw.decode("utf-8", errors="replace"), raw

    def _lp_text(self, entries, k: int):
        out = []
        for tid, (lp, alts) in entries:
            out.append((self._piece(tid)[0], lp, [(self._piece(a)[0], v) for a, v in alts[:k]]))
        return out

    def _lp_bytes(self, entries, k: int):
        out = []
        for tid, (lp, alts) in entries:
            text, raw = self._piece(tid)
            out.append((text, raw, lp, [(*self._piece(a), v) for a, v in alts[:k]]))
        return out

    def _engine_failed(self) -> BaseException | None:
        """The exception that ended AsyncEngine's loop task, if it died (then nothing is being computed)."""
        task = getattr(self.async_engine, "_task", None)
        if task is not None and task.done() and not task.cancelled():
            return task.exception()
        return None


def _cut_at_stop(content: str | None, stops: list[str]) -> str | None:
    """Parsed content ends before the first stop string, as the engine's text does (the parser reads ids, which
    run up to the token that completed the stop string)."""
    hits = [i for i in (content.find(s) for s in stops) if i >= 0] if content else []
    return (content[:min(hits)] or None) if hits else content


def _consume(future: asyncio.Future) -> None:
    """Read a finished future's outcome, so that asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class _Stream(StreamingResponse):
    """A server-sent-event stream that runs `cleanup` however the response ends (the generator may be left
    suspended when the framework cancels the send)."""

    def __init__(self, body, cleanup):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


class _Middleware:
    """Pure ASGI, before any route: the Host header check (DNS rebinding) and the API key check (every route but
    /health), refusal of new requests while shutting down, and the count of responses by status code."""

    def __init__(self, app: FastAPI, server: OpenAIServer):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        counted = path not in ("/metrics", "/health")

        async def send_counted(message):
            if counted and message["type"] == "http.response.start":
                self.server.metrics.http.inc(label=str(message["status"]))
            await send(message)

        if path not in ("/health", "/disagg/clock"):     # a steady clock reading is no secret (disagg/clocks.py)
            refusal = self._refusal(scope.get("headers") or [])
            if refusal is not None:
                return await refusal(scope, receive, send_counted)
        return await self.app(scope, receive, send_counted)

    def _refusal(self, headers) -> Response | None:
        server = self.server
        if server.hosts is not None:
            hosts = [v for k, v in headers if k == b"host"]
            why = server.hosts.refuse(hosts)
            if why is not None:
                return _JSON(P.error_body(why, "invalid_request_error", None, "invalid_host"), status_code=400)
        if server.api_keys:
            auth = [v for k, v in headers if k == b"authorization"]
            if len(auth) > 1:
                return _JSON(P.error_body("the request has more than one Authorization header; send one",
                                          "invalid_request_error", None, "invalid_api_key"), status_code=400)
            why = check_bearer(auth[0] if auth else None, server.api_keys)
            if why is not None:
                return _JSON(P.error_body(why, "invalid_request_error", None, "invalid_api_key"), status_code=401,
                             headers={"WWW-Authenticate": "Bearer"})
        if server.draining:
            return _JSON(P.error_body("the server is shutting down; send the request to another server or later",
                                      "server_error", None, "server_shutdown"), status_code=503)
        return None


def _check_json_type(values: list[str]) -> None:
    """A request body must say it is JSON (415 otherwise): a browser page cannot send that type to another origin
    without a CORS preflight, which this server never grants."""
    media = values[0].split(";", 1)[0].strip().lower() if len(values) == 1 else ""
    if media != "application/json":
        got = "no Content-Type" if not values else f"Content-Type {P.show(', '.join(values))}"
        raise P.APIError(415, f"the request body must be JSON sent with `Content-Type: application/json`; got "
                              f"{got}", code="unsupported_media_type")


def create_app(engine: Engine, served_model_name: str | None = None, api_keys: tuple[str, ...] = (),
               limits: P.Limits = P.Limits(), hosts: HostCheck | None = None, body_timeout: float = 30.0,
               chat_format: str = "auto", tool_call_parser: str | None = None, reasoning_parser: str | None = None):
    """The ASGI app serving `engine` (give it to uvicorn); `app.server` is the `OpenAIServer`. The chat flags are
    `ChatFormat`'s; a bad one raises KestrelError."""
    chat = None
    if engine.tokenizer is not None:
        chat = ChatFormat(engine.tokenizer, engine.config.vocab_size, engine.eos_ids, chat_format, tool_call_parser,
                          reasoning_parser)
    server = OpenAIServer(engine, served_model_name, api_keys, limits, hosts, body_timeout, chat)
    app = server.app
    app.server = server
    return app
