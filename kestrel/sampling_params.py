"""Per-request sampling parameters (the public `SamplingParams`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kestrel.errors import RequestError

# Temperatures below this sample as greedy: dividing logits by a smaller one only sharpens an already one-hot
# distribution, and in fp32 it would overflow (1e-39 is a denormal, 1e-46 rounds to 0).
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 (or anything below GREEDY_BELOW) = greedy
    top_k: int = 0                    # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # number of top logprobs to return per generated token (server)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (list, tuple)) or self.stop is None:   # anything else is rejected by validate()
            self.stop = list(self.stop or [])
        self.validate()

    def validate(self) -> None:
        def bad(field_name: str, why: str) -> RequestError:
            return RequestError(f"{field_name} = {getattr(self, field_name)!r}: {why}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 1, or 0 / -1 to disable")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, (list, tuple)) \
                or not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in 0..20")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
