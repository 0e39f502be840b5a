"""Continuous batching with chunked prefill under a token budget.

Every step: running requests first (decodes before prefill chunks, each group in admission order), then waiting
requests are admitted in arrival order while the budget, `max_num_seqs`, the slots and the pages allow. When a
running request cannot get a page, the most recently admitted running request is preempted by recompute: its pages
and slot are returned (a token budget it was given this step is handed back) and it goes back to the front of the
queue with its generated tokens kept, so its output is unchanged: on re-admission it reads its prompt and its
outputs again (restoring what the prefix cache still holds) and carries on. A step that had to preempt admits no
one (the pages are short: a newcomer would be the next victim).

Speculation: a decoding request the policy lets speculate is given 1 + K tokens (its last token and K drafts: a
verify block) when the budget and the pages allow; otherwise it decodes plainly (never preempting for drafts).

Async scheduling (runtime/engine.py): `plan_ahead` plans the next pure-decode step while the last one's tokens are
not known yet, on the assumption that each of its requests continues one token; anything that would need the
scheduler's full pass (admission, preemption, a request outside the step) makes it refuse, and the engine drains.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kestrel.runtime.cache import HybridCache
from kestrel.runtime.request import Request, Status


@dataclass
class Scheduled:
    req: Request
    num_tokens: int      # tokens this step reads, starting at req.num_computed
    drafts: int = 0      # speculation: of those, the draft tokens after the last token (num_tokens = 1 + drafts)
    # the proposer's drafts on the host (the engine fills them); None: they stay on the device (a block of K a row)
    draft_tokens: list[int] | None = field(default_factory=list)
    prob_row: int = -1                                      # this block's row of the proposer's draft probs


class Scheduler:
    def __init__(self, cache: HybridCache, max_num_seqs: int, max_num_batched_tokens: int, draft_len=None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.cache = cache
        self.max_num_seqs = min(max_num_seqs, cache.num_slots)
        self.budget = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []      # admission order (the last one is preempted first)
        self.num_preemptions = 0
        # speculation: draft tokens a decoding request verifies this step (kestrel/spec/policy.py); None: never
        self.draft_len = draft_len

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request, release: bool = True) -> None:
        """Take `req` out of the queues; a running request's pages and slot go back unless `release` is False (a
        launched step still writes them: the engine releases them once that step is done)."""
        if req.status == Status.RUNNING and req in self.running:
            self.running.remove(req)
            if release:
                self.cache.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def finish(self, req: Request, release: bool = True) -> None:
        """`req` ended: out of the running batch; its pages and slot go back unless `release` is False (as `abort`)."""
        self.running.remove(req)
        if release:
            self.cache.release(req)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.cache.release(victim)
        victim.num_computed = 0
        victim.status = Status.WAITING
        victim.metrics.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def plan_ahead(self, live: list[Request]) -> list[Request] | None:
        """The next step when the last step (a pure decode of `live`, its requests still running) has sampled a
        token for each request that the host has not read yet: each decodes that token (one position on, a page
        where it crosses a page boundary), except a request whose token is its last by length (known to end: a stop
        token or string is known only once the token is read, so such a request gets a row whose token is
        dropped). None when this step's plan may differ from `schedule()`'s: a request could be admitted, a running
        request is not in `live`, the budget or a page is short, or every request ends. Pages taken before a
        refusal are the ones `schedule()` asks for next anyway."""
        if not live or len(live) != len(self.running) or len(live) > self.budget:
            return None
        if self.waiting and len(self.running) < self.max_num_seqs and self.cache.free_slot_count:
            return None
        ahead = [r for r in live if len(r.output_token_ids) + 1 < r.params.max_tokens and r.num_tokens + 1 < r.max_len]
        for r in ahead:
            if not self.cache.grow(r, r.num_computed + 1):
                return None
        return ahead or None

    def schedule(self) -> list[Scheduled]:
        budget = self.budget
        out: dict[int, Scheduled] = {}      # id(req) -> its entry, in scheduling order
        preempted = self.num_preemptions
        for req in sorted(self.running, key=lambda r: not r.is_decoding):   # stable: decodes first
            if budget == 0:
                break
            if req.status != Status.RUNNING:       # preempted earlier in this loop
                continue
            n = min(req.remaining, budget)
            drafts = min(self.draft_len(req), budget - 1) if self.draft_len and req.is_decoding else 0
            if drafts > 0 and self.cache.grow(req, req.num_computed + 1 + drafts):
                out[id(req)] = Scheduled(req, 1 + drafts, drafts)       # a verify block
                budget -= 1 + drafts
                continue
            while not self.cache.grow(req, req.num_computed + n):       # short of pages: plain decode first
                victim = self.running[-1]
                given = out.pop(id(victim), None)
                if given is not None:
                    budget += given.num_tokens
                self._preempt(victim)
                if victim is req:
                    break
            else:
                out[id(req)] = Scheduled(req, n)
                budget -= n
        if self.num_preemptions != preempted and out:
            return list(out.values())       # pages are short: admitting now would only be preempted again
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.cache.acquire_slot(req):
                break
            hit = self.cache.match_prefix(req)
            req.num_computed = hit
            n = min(req.remaining, budget)
            if not self.cache.grow(req, req.num_computed + n):
                self.cache.release(req)
                req.num_computed = 0
                break
            self.waiting.popleft()
            if req.metrics.preemptions == 0:
                req.metrics.cached_tokens = hit
                self.cache.count_lookup(len(req.prompt_token_ids), hit)
            req.status = Status.RUNNING
            self.running.append(req)
            out[id(req)] = Scheduled(req, n)
            budget -= n
        return list(out.values())
