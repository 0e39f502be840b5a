"""When speculation pays: decided per step and per request, from measured times and measured acceptance.

A speculating request gains 1 + a tokens from a step (a = drafts accepted) where a plain decode gains 1. With,
at the step's batch size B (bucketed to a power of two), the running averages of the measured times
  t_decode(B): a pure decode step (model + sampling),
  t_verify(B): a step that verifies blocks (model + acceptance), and
  t_draft(B):  the proposer's time for that step,
speculation is worth its step when  (1 + a) / (t_draft + t_verify) >= 1 / t_decode,  i.e. when the request's
acceptance length
  L = 1 + EMA(a)  >=  L* = (t_draft(B) + t_verify(B)) / t_decode(B)        (the break-even),
where a request's estimate starts as one pseudo-block at the EMA over all requests' blocks (1 + K/2 before the
first), its first blocks are averaged and the EMA takes over after 1/ema blocks (one unlucky first block must not
switch a request off).
So each decoding request speculates when its own measured L is at or above the break-even of the current batch
size. The times are learnt by doing: at a batch size with no verify time yet everyone speculates; with a verify
time and no decode time the step decodes plainly; and every `REMEASURE_EVERY`-th step at a size is a plain one, so
t_decode follows the context length as it grows. A request
switched off is probed again every `PROBE_EVERY` of its steps, so a request whose text turns repetitive later
gets speculation back. Above `disable_by_batch_size` decoding requests no one speculates (large batches are
compute bound: the K extra rows per request cost as much as they save). `enforce` pins speculation on for every
request (tests, benchmarks of the verify path).

Requests with a grammar or asking for logprobs decode plainly (their masks and logprobs are per sampled token).
"""

from __future__ import annotations

from kestrel.config import SpeculativeConfig

PROBE_EVERY = 8
REMEASURE_EVERY = 32


def size_bucket(n: int) -> int:
    """The power of two at or above n: the batch sizes whose times are averaged together."""
    return 1 << max(0, n - 1).bit_length()


class _Ema:
    def __init__(self, weight: float):
        self.weight, self.values = weight, {}

    def add(self, key, value: float) -> None:
        old = self.values.get(key)
        self.values[key] = value if old is None else old + self.weight * (value - old)

    def get(self, key) -> float | None:
        return self.values.get(key)


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.k = config.num_speculative_tokens
        self.decode_s, self.verify_s, self.draft_s = _Ema(config.ema), _Ema(config.ema), _Ema(config.ema)
        self.accept_len: dict[str, float] = {}       # request id -> EMA of 1 + accepted drafts
        self.mean_accept_len: float | None = None    # the same over every request's blocks
        self._blocks: dict[str, int] = {}            # request id -> its verify blocks so far
        self._skipped: dict[str, int] = {}           # request id -> steps decoded plainly since it last speculated
        self._bucket = 1
        self._off = False
        self._steps: dict[int, int] = {}             # bucket -> steps begun there

    # ---- per step ------------------------------------------------------------------------------------------------
    def begin_step(self, num_decoding: int) -> None:
        b = self._bucket = size_bucket(num_decoding)
        limit = self.config.disable_by_batch_size
        self._off = not self.config.enforce and limit is not None and num_decoding > limit
        if not self.config.enforce and not self._off:
            # a plain decode step where its time is unknown or getting old, so the break-even stays measured
            self._steps[b] = self._steps.get(b, 0) + 1
            measured = self.verify_s.get(b) is not None
            stale = self._steps[b] % REMEASURE_EVERY == 0
            self._off = measured and (self.decode_s.get(b) is None or stale)

    def break_even(self, bucket: int | None = None) -> float | None:
        """L* at this batch-size bucket, or None while a time is still unmeasured."""
        b = self._bucket if bucket is None else bucket
        dec, ver = self.decode_s.get(b), self.verify_s.get(b)
        if dec is None or ver is None or dec <= 0:
            return None
        return (ver + (self.draft_s.get(b) or 0.0)) / dec

    def draft_len(self, req) -> int:
        """Draft tokens to verify for this decoding request this step (0: plain decode)."""
        p = req.params
        if self._off or req.grammar is not None or p.logprobs is not None:
            return 0
        # never draft past max_tokens (the bonus token is one more) or past the context the request may fill
        n = min(self.k, p.max_tokens - len(req.output_token_ids) - 1, req.max_len - req.num_tokens)
        if n <= 0:
            return 0
        if self.config.enforce:
            return n
        star = self.break_even()
        mine = self.accept_len.get(req.request_id)
        if star is None or mine is None or mine >= star:
            self._skipped.pop(req.request_id, None)
            return n
        skipped = self._skipped.get(req.request_id, 0) + 1
        if skipped >= PROBE_EVERY:
            self._skipped.pop(req.request_id, None)
            return n
        self._skipped[req.request_id] = skipped
        return 0

    # ---- measurements --------------------------------------------------------------------------------------------
    def record_step(self, verify: bool, batch_size: int, seconds: float, draft_seconds: float = 0.0) -> None:
        b = size_bucket(batch_size)
        if verify:
            self.verify_s.add(b, seconds)
            self.draft_s.add(b, draft_seconds)
        else:
            self.decode_s.add(b, seconds)

    def record_acceptance(self, request_id: str, accepted: int) -> None:
        """A request's estimate starts as one pseudo-block at the average over all requests (1 + K/2 before any
        block was seen), so one unlucky first block does not switch it off; the first blocks are averaged, then
        the EMA takes over."""
        v = 1.0 + accepted
        n = self._blocks.get(request_id, 0)
        prior = self.accept_len.get(request_id)
        if prior is None:
            prior = self.mean_accept_len if self.mean_accept_len is not None else 1.0 + self.k / 2
        w = max(self.config.ema, 1.0 / (n + 2))
        self.accept_len[request_id] = prior + w * (v - prior)
        self._blocks[request_id] = n + 1
        m = self.mean_accept_len
        self.mean_accept_len = v if m is None else m + self.config.ema * (v - m)

    def forget(self, request_id: str) -> None:
        self.accept_len.pop(request_id, None)
        self._skipped.pop(request_id, None)
        self._blocks.pop(request_id, None)
