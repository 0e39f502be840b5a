"""The hybrid cache: paged MLA latents and KDA state slots, owned as one request state.

- Pages: `num_pages` pages of `page_size` tokens for every MLA layer; a request holds a list of pages (its row of
  the block table). Pages are reference counted so a cached prefix can be shared.
- Slots: one KDA state slot (conv + recurrent, every KDA layer) per running request. A slot index is also the
  request's row in the block table. The block table lives on the device as one tensor `[num_slots + 1, max_pages]`
  that is updated incrementally: an entry is written when a page is added to a request (on a GPU the changed
  entries go in one indexed copy per step, `flush_block_tables`, however long a row), never rebuilt per step.
- Scratch: one page past `num_pages`, one state slot past the snapshots and one block-table row past the request
  rows (naming only the scratch page) are never handed out: a CUDA-graph decode step's padding rows run there
  (runtime/graphs.py), so they never touch a request's state.
- Layers are data: `add_layers` appends more layers (a drafter's) to the same pools, sized by the same page and
  slot counts, so they share one budget and one block table.
- Prefix caching: a full prompt page is keyed by a chained hash (blake2b over the previous page's key and this
  page's tokens, so a key covers every token before the page's end; collisions are cryptographically unlikely,
  which keeps a hit exact). A KDA *snapshot* (a copy of the request's state slot into a spare slot of the same
  pools) is taken at each page boundary of the prompt, keyed by the same hash. A hit needs both: pages 0..j-1 by
  hash and the snapshot at boundary j, so the restored request has exactly the MLA latents and the KDA state a
  cold run would have. Unreferenced cached pages and snapshots are evicted least recently used first (a request's
  pages are released tail first, so the end of a cached chain goes before its head).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

import torch

from kestrel.config import KDA, MLA, ModelConfig
from kestrel.models.kimi.step import CachePools, page_formats
from kestrel.quant.kv_cache import KvPageFormat
from kestrel.runtime.inputs import PinnedStaging
from kestrel.runtime.request import Request


def chain_hashes(tokens, page_size: int, known: list[bytes] | None = None) -> list[bytes]:
    """Key of each full page, chained so that a page's key covers every token before it too. `known` (keys of a
    prefix of the same tokens, e.g. from an earlier admission of the same request) is reused, not rehashed.
    `tokens`: a list of ints or an int64 `array` (Request.prompt_array: hashed from its bytes, no conversion); a
    page hashes its tokens' int64 bytes either way, so the keys are the same."""
    n = len(tokens) // page_size
    out = list(known or [])[:n]
    if len(out) == n:
        return out
    # the pages still to hash, as one int64 buffer read a page at a time (a conversion a page cost 1.6x more)
    first = len(out) * page_size
    if isinstance(tokens, array) and tokens.typecode == "q":
        buf = memoryview(tokens)[first:n * page_size]
    else:
        buf = memoryview(array("q", tokens[first:n * page_size]))
    h = out[-1] if out else b""
    for i in range(n - len(out)):
        m = hashlib.blake2b(h, digest_size=16)
        m.update(buf[i * page_size:(i + 1) * page_size])
        h = m.digest()
        out.append(h)
    return out


class HybridCache:
    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, num_slots: int, num_snapshots: int,
                 max_pages_per_seq: int, dtype: torch.dtype, device: torch.device, prefix_caching: bool = True,
                 kv_formats: dict[int, KvPageFormat] | None = None, state_dtype: torch.dtype = torch.float32,
                 extra_kv_kind: str = "auto", extra_mla: dict[int, int] | None = None,
                 pool_page_size: int | None = None):
        """`kv_formats`: each MLA layer's page format (default: plain rows in `dtype`); `state_dtype`: the KDA
        recurrent state's; `extra_kv_kind`: the KV cache dtype of MLA layers added later (`add_layers`);
        `extra_mla`: a drafter's MLA layers (layer id -> latent width), pages in the same pools: same page ids,
        same block table, same budget (the plan counts them: `plan_cache(extra_mla=...)`); `pool_page_size`:
        latents a page holds on this rank (Helix spreads a page's tokens over its ranks)."""
        self.config, self.page_size, self.device, self.dtype = config, page_size, torch.device(device), dtype
        self.num_pages, self.num_slots, self.num_snapshots = num_pages, num_slots, num_snapshots
        self.scratch_page, self.scratch_slot, self.scratch_row = num_pages, num_slots + num_snapshots, num_slots
        self.state_dtype, self.extra_kv_kind = state_dtype, extra_kv_kind
        self.pools = CachePools.allocate(config, num_pages + 1, pool_page_size or page_size,
                                         num_slots + num_snapshots + 1, dtype, device, kv_formats=kv_formats,
                                         state_dtype=state_dtype, extra_mla=extra_mla)
        self.layer_kinds: dict[int, str] = {i: config.layer_kinds[i] for i in range(config.num_layers)}
        self.layer_kinds.update({i: MLA for i in (extra_mla or {})})
        self.prefix_caching = prefix_caching
        self.free_pages: deque[int] = deque(range(num_pages))
        self.ref = [0] * num_pages
        self._used_pages = 0
        self.page_key: list[bytes | None] = [None] * num_pages
        self.page_of_key: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()      # cached pages with no reader, LRU first
        self.free_slots: deque[int] = deque(range(num_slots))
        self.free_snapshots: deque[int] = deque(range(num_slots, num_slots + num_snapshots))
        self.snapshot_of_key: OrderedDict[bytes, int] = OrderedDict()  # key -> snapshot slot, LRU first
        self.max_pages_per_seq = max_pages_per_seq
        # the block table: host mirror (the bookkeeping's truth) and the device tensor the model reads
        self.block_tables_host = torch.full((num_slots + 1, max_pages_per_seq), -1, dtype=torch.int32)
        self.block_tables_host[self.scratch_row] = self.scratch_page
        if self.device.type == "cpu":
            self.block_tables = self.block_tables_host
        else:
            self.block_tables = self.block_tables_host.to(self.device)
        self._dirty: set[int] = set()        # flat indices of block-table entries changed since the last flush
        self._staging = PinnedStaging(self.device)
        self.hit_tokens = 0           # prompt tokens restored from the cache (first admissions)
        self.queried_tokens = 0       # prompt tokens looked up (first admissions)
        self.evicted_pages = 0
        self.evicted_snapshots = 0

    # ---- layers --------------------------------------------------------------------------------------------
    def add_layers(self, kinds: dict[int, str], config: ModelConfig | None = None) -> None:
        """Append layers (e.g. a drafter's) to the pools: MLA layers get `[num_pages, page_size, W]` pages read
        through the same block table, KDA layers get state slots for every request slot and snapshot. `config`
        gives the layers' widths (default: the model's)."""
        c = config or self.config
        taken = sorted(set(kinds) & set(self.layer_kinds))
        if taken:
            raise ValueError(f"layers {taken} are already in the cache pools")
        bad = {i: k for i, k in kinds.items() if k not in (MLA, KDA)}
        if bad:
            raise ValueError(f"layer kinds must be {MLA!r} or {KDA!r}, got {bad}")
        slots = self.num_slots + self.num_snapshots + 1          # + the scratch slot
        for i, kind in sorted(kinds.items()):
            if kind == MLA:
                fmt = page_formats(c, self.dtype, {i: self.extra_kv_kind})[i]
                self.pools.add_mla(i, fmt, self.num_pages + 1, self.device)
            else:
                self.pools.conv[i] = torch.zeros(slots, 3 * c.kda_width, c.conv_kernel_size - 1, dtype=self.dtype,
                                                 device=self.device)
                self.pools.recurrent[i] = torch.zeros(slots, c.kda_num_heads, c.kda_head_dim, c.kda_head_dim,
                                                      dtype=self.state_dtype, device=self.device)
            self.layer_kinds[i] = kind
        # cached snapshots were taken without the new layers' state: they can no longer restore a request
        if any(k == KDA for k in kinds.values()):
            self.drop_prefix_cache()

    def layout(self) -> dict:
        """What a peer must match to exchange pages and states with this cache (disaggregated handshake)."""
        return {"page_size": self.page_size, "dtype": str(self.dtype).replace("torch.", ""),
                "mla_layers": sorted(self.pools.mla), "kda_layers": sorted(self.pools.conv),
                "mla_width": {i: t.shape[-1] for i, t in sorted(self.pools.mla.items())},
                "mla_format": {i: f.kind for i, f in sorted(self.pools.mla_format.items())},
                "kda_state_dtype": str(self.state_dtype).replace("torch.", "")}

    def nbytes(self) -> int:
        pools = list(self.pools.mla.values()) + list(self.pools.conv.values()) + list(self.pools.recurrent.values())
        return sum(t.numel() * t.element_size() for t in pools)

    # ---- accounting ------------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages a request can get now: free ones plus cached pages nobody reads (evicted on demand)."""
        return len(self.free_pages) + len(self.evictable)

    @property
    def used_pages(self) -> int:
        return self._used_pages

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self.free_slots)

    @property
    def free_slot_count(self) -> int:
        return len(self.free_slots)

    def usage(self) -> float:
        return self._used_pages / max(self.num_pages, 1)

    def pages_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(req.pages))

    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def count_lookup(self, prompt_tokens: int, hit: int) -> None:
        self.queried_tokens += prompt_tokens
        self.hit_tokens += hit

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
        self.evicted_pages += 1
        return page

    def _ref(self, page: int) -> None:
        if self.ref[page] == 0:
            self._used_pages += 1
        self.ref[page] += 1

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` pages for its first `num_tokens` tokens; False (and nothing taken) if the pool is short."""
        need = self.pages_needed(req, num_tokens)
        if need > self.num_free_pages or len(req.pages) + need > self.max_pages_per_seq:
            return False
        # free pages first, straight off the deque, then evictions; every page taken had no reader, so each gets
        # its first reference (a method call or two a page cost an 8K prompt's 128 pages ~0.1 ms)
        free, ref = self.free_pages, self.ref
        pages = [free.popleft() for _ in range(min(need, len(free)))]
        pages += [self._take_page() for _ in range(need - len(pages))]
        for page in pages:
            ref[page] = 1
        self._used_pages += need
        self._append_pages(req, pages)
        return True

    def _append_pages(self, req: Request, pages: list[int]) -> None:
        """Pages onto the end of `req`'s block-table row: one slice write (an element write per page cost an 8K
        prompt's 128 pages ~2 ms of host time before its prefill could launch)."""
        if not pages:
            return
        n0 = len(req.pages)
        if len(pages) == 1:
            self.block_tables_host[req.slot, n0] = pages[0]
        else:
            self.block_tables_host[req.slot, n0:n0 + len(pages)] = torch.tensor(pages, dtype=torch.int32)
        base = req.slot * self.max_pages_per_seq
        self._dirty.update(range(base + n0, base + n0 + len(pages)))
        req.pages.extend(pages)

    def flush_block_tables(self) -> None:
        """Bring the device block table up to date: the entries changed since the last step, in one pinned upload
        and one indexed copy (a long row, e.g. a prefix hit of many pages, is just more entries)."""
        if not self._dirty:
            return
        if self.block_tables is not self.block_tables_host:
            idx = torch.tensor(sorted(self._dirty), dtype=torch.long)
            n = idx.numel()
            host = self._staging.take(2 * n)
            host[:n] = idx
            host[n:] = self.block_tables_host.view(-1)[idx]
            dev = host.to(self.device, non_blocking=True)
            self._staging.done()
            self.block_tables.view(-1).index_copy_(0, dev[:n], dev[n:].to(torch.int32))
        self._dirty.clear()

    def trim(self, req: Request) -> None:
        """Give back req's pages past its computed tokens (a verify block's rejected drafts): they hold only
        positions that will be written again. Never a prompt page (those are computed before any speculation)."""
        keep = -(-req.num_computed // self.page_size)
        while len(req.pages) > keep:
            page = req.pages.pop()
            self._unref(page)
            i = len(req.pages)
            self.block_tables_host[req.slot, i] = -1
            self._dirty.add(req.slot * self.max_pages_per_seq + i)

    def _unref(self, page: int) -> None:
        self.ref[page] -= 1
        if self.ref[page] < 0:
            raise AssertionError(f"page {page} released more often than referenced")
        if self.ref[page] == 0:
            self._used_pages -= 1
            if self.page_key[page] is not None:
                self.evictable[page] = None
            else:
                self.free_pages.append(page)

    def release(self, req: Request) -> None:
        """Return a finished, aborted or preempted request's pages and slot (cached pages stay findable). Pages go
        back tail first, so LRU eviction takes the end of a cached chain before its head."""
        for page in reversed(req.pages):
            self._unref(page)
        if req.slot is not None:
            self.block_tables_host[req.slot, :len(req.pages)] = -1
            row = req.slot * self.max_pages_per_seq
            self._dirty.update(range(row, row + len(req.pages)))
            self.free_slots.append(req.slot)
        req.pages, req.slot, req.committed_pages = [], None, 0

    # ---- prefix caching ------------------------------------------------------------------------------------
    def match_prefix(self, req: Request) -> int:
        """Restore the longest cached prefix of req's prompt (pages + KDA snapshot) into req, which holds a slot and
        no pages; returns its length in tokens. At least one prompt token is always left to compute: its logits
        give the next output token."""
        prompt = req.prompt_token_ids
        if not self.prefix_caching:
            return 0
        req.page_hashes = chain_hashes(req.prompt_array if req.prompt_array is not None else prompt,
                                       self.page_size, req.page_hashes)
        j = 0
        while j < len(req.page_hashes) and req.page_hashes[j] in self.page_of_key:
            j += 1
        while j > 0 and (j * self.page_size >= len(prompt) or req.page_hashes[j - 1] not in self.snapshot_of_key):
            j -= 1
        if j == 0:
            return 0
        pages = [self.page_of_key[key] for key in req.page_hashes[:j]]
        for page in pages:
            if self.ref[page] == 0:
                self.evictable.pop(page, None)
            self._ref(page)
        self._append_pages(req, pages)      # one slice write of the row (a hit of 127 pages wrote 127 elements)
        req.committed_pages = j
        snap = self.snapshot_of_key[req.page_hashes[j - 1]]
        self.snapshot_of_key.move_to_end(req.page_hashes[j - 1])
        self._copy_state(snap, req.slot)
        return j * self.page_size

    def snapshot_wanted(self, req: Request, boundary: int) -> bool:
        """Whether to snapshot req's state after `boundary` tokens (a page boundary inside its prompt)."""
        if not (self.prefix_caching and self.num_snapshots) or boundary % self.page_size:
            return False
        i = boundary // self.page_size - 1
        return 0 <= i < len(req.page_hashes) and boundary < len(req.prompt_token_ids) \
            and req.page_hashes[i] not in self.snapshot_of_key

    def take_snapshot_slot(self, key: bytes) -> int:
        """A slot to copy a state into for `key`, evicting the least recently used snapshot if none is free."""
        if self.free_snapshots:
            slot = self.free_snapshots.popleft()
        else:
            _, slot = self.snapshot_of_key.popitem(last=False)
            self.evicted_snapshots += 1
        self.snapshot_of_key[key] = slot
        return slot

    def forget_snapshots(self, slots: list[int]) -> None:
        """Drop the snapshots held in these slots (a step that was to write them failed)."""
        gone = set(slots)
        for key in [k for k, s in self.snapshot_of_key.items() if s in gone]:
            self.free_snapshots.append(self.snapshot_of_key.pop(key))

    def commit_pages(self, req: Request) -> None:
        """Make req's full, computed prompt pages findable by their hashes (each page once: `committed_pages`)."""
        if not self.prefix_caching:
            return
        full = min(min(req.num_computed, len(req.prompt_token_ids)) // self.page_size, len(req.page_hashes))
        for i in range(req.committed_pages, full):
            page, key = req.pages[i], req.page_hashes[i]
            if self.page_key[page] is None and key not in self.page_of_key:
                self.page_key[page] = key
                self.page_of_key[key] = page
        req.committed_pages = max(req.committed_pages, full)

    def drop_prefix_cache(self) -> None:
        """Forget every cached page and snapshot (pages in use stay with their requests)."""
        for page in list(self.evictable):
            self.free_pages.append(page)
        self.evictable.clear()
        for key, page in self.page_of_key.items():
            self.page_key[page] = None
        self.page_of_key.clear()
        self.free_snapshots.extend(self.snapshot_of_key.values())
        self.snapshot_of_key.clear()

    def _copy_state(self, src: int, dst: int) -> None:
        for pool in list(self.pools.conv.values()) + list(self.pools.recurrent.values()):
            pool[dst].copy_(pool[src])
