"""The hybrid cache: paged MLA latents and KDA state slots, owned as one request state.

- Pages: `num_pages` pages of `page_size` tokens for every MLA layer; a request holds a list of pages (its row of
  the block table). Pages are reference counted so a cached prefix can be shared.
- Slots: one KDA state slot (conv + recurrent, every KDA layer) per running request. A slot index is also the
  request's row in the device block table, which is updated one entry at a time as pages are added.
- Prefix caching: a full prompt page is keyed by a chained hash of all tokens up to its end. A KDA *snapshot*
  (a copy of the request's state slot into a spare slot of the same pools) is taken at each page boundary of the
  prompt, keyed by the same hash. A hit needs both: pages 0..j-1 by hash and the snapshot at boundary j, so the
  restored request has exactly the MLA latents and the KDA state a cold run would have. Unreferenced cached pages
  and snapshots are evicted least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from kestrel.config import ModelConfig
from kestrel.models.kimi.step import CachePools
from kestrel.runtime.request import Request


def chain_hashes(tokens: list[int], page_size: int) -> list[int]:
    """Hash of each full page, chained so that a page's key covers every token before it too."""
    out, h = [], 0
    for i in range(len(tokens) // page_size):
        h = hash((h, tuple(tokens[i * page_size:(i + 1) * page_size])))
        out.append(h)
    return out


class HybridCache:
    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, num_slots: int, num_snapshots: int,
                 max_pages_per_seq: int, dtype: torch.dtype, device: torch.device, prefix_caching: bool = True):
        self.config, self.page_size, self.device = config, page_size, device
        self.num_pages, self.num_slots, self.num_snapshots = num_pages, num_slots, num_snapshots
        self.pools = CachePools.allocate(config, num_pages, page_size, num_slots + num_snapshots, dtype, device)
        self.prefix_caching = prefix_caching
        self.free_pages: deque[int] = deque(range(num_pages))
        self.ref = [0] * num_pages
        self.page_key: list[int | None] = [None] * num_pages
        self.page_of_key: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()      # cached pages with no reader, LRU first
        self.free_slots: deque[int] = deque(range(num_slots))
        self.free_snapshots: deque[int] = deque(range(num_slots, num_slots + num_snapshots))
        self.snapshot_of_key: OrderedDict[int, int] = OrderedDict()  # key -> snapshot slot, LRU first
        self.block_tables = torch.full((num_slots, max_pages_per_seq), -1, dtype=torch.int32, device=device)
        self.max_pages_per_seq = max_pages_per_seq
        self.hit_tokens = 0
        self.queried_tokens = 0

    # ---- accounting ------------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages) + len(self.evictable)

    @property
    def used_pages(self) -> int:
        return sum(1 for r in self.ref if r > 0)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self.free_slots)

    def usage(self) -> float:
        return self.used_pages / max(self.num_pages, 1)

    def pages_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(req.pages))

    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    # ---- slots ---------------------------------------------------------------------------------------------
    def acquire_slot(self, req: Request) -> bool:
        if not self.free_slots:
            return False
        req.slot = self.free_slots.popleft()
        self.pools.reset_slots([req.slot])
        return True

    # ---- pages ---------------------------------------------------------------------------------------------
    def _take_page(self) -> int:
        if self.free_pages:
            return self.free_pages.popleft()
        page, _ = self.evictable.popitem(last=False)
        key = self.page_key[page]
        if key is not None:
            del self.page_of_key[key]
            self.page_key[page] = None
        return page

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` pages for its first `num_tokens` tokens; False (and nothing taken) if the pool is short."""
        need = self.pages_needed(req, num_tokens)
        if need > self.num_free_pages:
            return False
        if len(req.pages) + need > self.max_pages_per_seq:
            return False
        for _ in range(need):
            page = self._take_page()
            self.ref[page] = 1
            self._append_page(req, page)
        return True

    def _append_page(self, req: Request, page: int) -> None:
        self.block_tables[req.slot, len(req.pages)] = page
        req.pages.append(page)

    def release(self, req: Request) -> None:
        """Return a finished, aborted or preempted request's pages and slot (cached pages stay findable)."""
        for page in req.pages:
            self.ref[page] -= 1
            if self.ref[page] == 0:
                if self.page_key[page] is not None:
                    self.evictable[page] = None
                else:
                    self.free_pages.append(page)
        if req.slot is not None:
            self.block_tables[req.slot, :len(req.pages)] = -1
            self.free_slots.append(req.slot)
        req.pages, req.slot = [], None

    # ---- prefix caching ------------------------------------------------------------------------------------
    def match_prefix(self, req: Request) -> int:
        """Restore the longest cached prefix of req's prompt (pages + KDA snapshot); returns its length in tokens.
        At least one prompt token is always left to compute: its logits give the first output token."""
        prompt = req.prompt_token_ids
        req.page_hashes = chain_hashes(prompt, self.page_size)
        self.queried_tokens += len(prompt)
        if not self.prefix_caching:
            return 0
        j = 0
        while j < len(req.page_hashes) and req.page_hashes[j] in self.page_of_key:
            j += 1
        while j > 0 and (j * self.page_size >= len(prompt) or req.page_hashes[j - 1] not in self.snapshot_of_key):
            j -= 1
        if j == 0:
            return 0
        for key in req.page_hashes[:j]:
            page = self.page_of_key[key]
            if self.ref[page] == 0:
                self.evictable.pop(page, None)
            self.ref[page] += 1
            self._append_page(req, page)
        snap = self.snapshot_of_key[req.page_hashes[j - 1]]
        self.snapshot_of_key.move_to_end(req.page_hashes[j - 1])
        self._copy_state(snap, req.slot)
        self.hit_tokens += j * self.page_size
        return j * self.page_size

    def snapshot_wanted(self, req: Request, boundary: int) -> bool:
        """Whether to snapshot req's state after `boundary` tokens (a page boundary inside its prompt)."""
        if not (self.prefix_caching and self.num_snapshots) or boundary % self.page_size:
            return False
        i = boundary // self.page_size - 1
        return 0 <= i < len(req.page_hashes) and boundary < len(req.prompt_token_ids) \
            and req.page_hashes[i] not in self.snapshot_of_key

    def take_snapshot_slot(self, key: int) -> int:
        """A slot to copy a state into for `key`, evicting the least recently used snapshot if none is free."""
        if self.free_snapshots:
            slot = self.free_snapshots.popleft()
        else:
            _, slot = self.snapshot_of_key.popitem(last=False)
        self.snapshot_of_key[key] = slot
        return slot

    def commit_pages(self, req: Request) -> None:
        """Make req's full, computed prompt pages findable by their hashes."""
        if not self.prefix_caching:
            return
        full = min(req.num_computed, len(req.prompt_token_ids)) // self.page_size
        for i in range(min(full, len(req.page_hashes))):
            page, key = req.pages[i], req.page_hashes[i]
            if self.page_key[page] is None and key not in self.page_of_key:
                self.page_key[page] = key
                self.page_of_key[key] = page

    def _copy_state(self, src: int, dst: int) -> None:
        for pool in list(self.pools.conv.values()) + list(self.pools.recurrent.values()):
            pool[dst].copy_(pool[src])
