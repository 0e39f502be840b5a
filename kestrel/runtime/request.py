"""A request's whole state in one place: tokens, progress, cache handles, sampling, metrics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

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


@dataclass(eq=False)     # identity: the scheduler's queues hold the object itself, never a copy
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    prompt: str | None = None
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

    @property
    def all_token_ids(self) -> list[int]:
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
