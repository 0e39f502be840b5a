"""A request's whole state in one place (nano-vllm's `Sequence`): tokens, progress, cache handles, sampling, text
and stop-string state, its output stream, metrics; and `RequestOutput`, what a step hands out for it.

Everything grows by appending: each token costs O(1) (the text held back for a stop string is bounded by the
longest stop string), and an output carries only what is new plus O(1) views of what came before.
"""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from kestrel.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Metrics:
    """Times are `time.monotonic()` seconds; token counts are this request's own."""
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0                # prompt tokens restored from the prefix cache at first admission
    generated_tokens: int = 0
    preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


class TextState:
    """Incremental detokenization and stop strings. `pieces` is the text handed out so far, one piece per
    emitting token; `pending` the decoded text held back because a stop string may be starting in it (at most the
    longest stop string minus one character, plus the newest token's text)."""

    def __init__(self, detokenizer, stops: list[str]):
        self.detokenizer = detokenizer            # an IncrementalDetokenizer, or None: no text (token ids only)
        self.stops = stops
        self.hold = max((len(s) - 1 for s in stops), default=0)
        self.pieces: list[str] = []
        self.pending = ""

    def add(self, token: int, final: bool) -> tuple[str, bool]:
        """The text this token makes visible, and whether a stop string ended the request (the text is cut before
        it). A stop string never starts in text already handed out: that text was at least `hold` characters
        short of the end when it was handed out, so any stop string through it was found then."""
        if self.detokenizer is None:
            return "", False
        new = self.detokenizer.add([token])
        if final:
            new += self.detokenizer.flush()
        if not new:
            return "", False
        self.pending += new
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = self.pending[:min(hits)]
            return self.flush(), True
        return self._emit(len(self.pending) - (0 if final else self.hold)), False

    def _emit(self, upto: int) -> str:
        if upto <= 0:
            return ""
        delta, self.pending = self.pending[:upto], self.pending[upto:]
        self.pieces.append(delta)
        return delta

    def flush(self) -> str:
        """Hand out everything held back (the request ended)."""
        return self._emit(len(self.pending))

    def text(self, num_pieces: int | None = None) -> str:
        return "".join(self.pieces if num_pieces is None else self.pieces[:num_pieces])


@dataclass(eq=False)     # identity: the scheduler's queues hold the object itself, never a copy
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                             # the sampler's random numbers are a function of (seed, token position)
    prompt: str | None = None
    sample_row: tuple = ()                # the sampler's packed parameters of this request (built once)
    text_state: TextState | None = None
    stream: object = None                 # AsyncEngine's asyncio.Queue of this request's outputs, if streamed
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_computed: int = 0                 # tokens whose MLA latents and KDA state are in the cache
    slot: int | None = None               # KDA state slot, also this request's row of the block table
    pages: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of this request's full prompt pages
    committed_pages: int = 0              # how many leading pages are already published in the prefix cache
    metrics: Metrics = field(default_factory=Metrics)
    max_len: int = 0                      # prompt + output may not exceed this (max_model_len)
    # grammar-constrained decoding: an object with `fill(row)` (its allowed-token bits into an int32 host row),
    # `accept(token) -> bool` and `is_finished` (kestrel.serve.chat.grammar.RequestGrammar); None: unconstrained
    grammar: object = None
    # disaggregated serving (runtime/handoff.py): called with the request when it finishes, before its pages and
    # slot go back, so a context server can copy its state out; None: nothing to do
    handoff: object = None
    # the prompt as one int64 buffer (array "q"), made once by `Engine.add_request`: a step's prompt chunk is a C
    # slice of it and the prefix cache hashes its pages straight from its bytes, where converting the Python ints
    # again cost ~0.1 ms per 8K tokens each time (None: those read `prompt_token_ids`)
    prompt_array: array | None = None

    @property
    def all_token_ids(self) -> list[int]:
        """A copy of prompt + output (O(length): for tests and checks, not per step)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def remaining(self) -> int:
        """Tokens the model still has to read before this request can produce its next token."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.remaining == 1 and bool(self.output_token_ids)


class Prefix(Sequence):
    """A read-only view of the first `n` items of a list that only grows: O(1) to make, sliced on demand."""
    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int):
        self._items, self._n = items, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            return self._items[start:stop:step]
        if not -self._n <= i < self._n:
            raise IndexError("index out of range")
        return self._items[i % self._n]

    def __eq__(self, other) -> bool:
        if isinstance(other, (Prefix, list, tuple)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._items[:self._n])


@dataclass(eq=False)
class RequestOutput:
    """What one step hands out for one request.

    `delta_text`, `delta_token_ids`, `delta_logprobs` are what this output adds; read those per output. The final
    output (`finished`, finish_reason "stop" | "length" | "abort") also carries the whole result: `text`,
    `token_ids` and `logprobs` are then the request's complete text, ids and (chosen logprob, top alternatives)
    entries. On an intermediate output they are cheap too but not free: `token_ids` and `logprobs` are read-only
    `Prefix` views of the request's lists as of this output (O(1) to make; len, index, slice, iterate, ==), and
    `text` is joined on access (O(length)), so never read `text` per intermediate output.
    """
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    finish_reason: str | None            # None while running
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list = field(default_factory=list)
    metrics: Metrics | None = None
    _req: Request | None = field(default=None, repr=False)
    _upto: tuple[int, int, int] = (0, 0, 0)          # tokens, logprob entries, text pieces as of this output

    @classmethod
    def of(cls, req: Request, delta_text: str = "", delta_token_ids: list[int] | None = None,
           delta_logprobs: list | None = None) -> RequestOutput:
        n_pieces = len(req.text_state.pieces) if req.text_state is not None else 0
        return cls(req.request_id, req.prompt, req.prompt_token_ids, req.finish_reason, delta_text,
                   delta_token_ids or [], delta_logprobs or [], req.metrics, req,
                   (len(req.output_token_ids), len(req.output_logprobs), n_pieces))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> Sequence[int]:
        ids = self._req.output_token_ids
        return ids if self.finished else Prefix(ids, self._upto[0])

    @property
    def logprobs(self) -> Sequence:
        lps = self._req.output_logprobs
        return lps if self.finished else Prefix(lps, self._upto[1])

    @property
    def text(self) -> str:
        ts = self._req.text_state
        return "" if ts is None else ts.text(None if self.finished else self._upto[2])
