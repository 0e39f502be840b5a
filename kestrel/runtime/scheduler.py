"""Continuous batching with chunked prefill under a token budget.

Every step: running requests first (decodes before prefill chunks), then waiting requests are admitted while the
budget, `max_num_seqs`, the slots and the pages allow. When a running request cannot get a page, the most recently
admitted running request is preempted by recompute: its pages and slot are returned and it goes back to the front
of the queue with its generated tokens kept, so its output is unchanged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kestrel.runtime.cache import HybridCache
from kestrel.runtime.request import Request, Status


@dataclass
class Scheduled:
    req: Request
    num_tokens: int      # tokens this step reads, starting at req.num_computed


class Scheduler:
    def __init__(self, cache: HybridCache, max_num_seqs: int, max_num_batched_tokens: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.cache.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.release(req)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.cache.release(victim)
        victim.num_computed = 0
        victim.status = Status.WAITING
        victim.metrics.preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self) -> list[Scheduled]:
        budget = self.budget
        out: list[Scheduled] = []
        self.running.sort(key=lambda r: not r.is_decoding)   # stable: decodes first, admission order kept
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:          # preempted below by an earlier request of this loop
                continue
            n = min(req.remaining, budget)
            while not self.cache.grow(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                out.append(Scheduled(req, n))
                budget -= n
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
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(Scheduled(req, n))
            budget -= n
        return out
