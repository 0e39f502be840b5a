"""One request's cache state out of an engine's pools and into another's (disaggregated serving).

A context server runs a request's prompt and samples its first token; `export_state` then copies everything the
cache holds for it (every layer key of the page-indexed pools for its pages, every layer key of the slot-indexed
pools for its slot: the target's MLA layers and KDA conv + recurrent state, and a drafter's appended layers, which
are more keys of the same dicts) into one flat byte buffer with a manifest and a checksum. A generation server
checks the checksum on what arrived, then `admit_imported` gives the request fresh pages and a slot, copies the
state in and puts it straight into the running batch with its first token: all or nothing. When the generation
server has no free slot or pages at that moment, the request simply stays queued and is computed there from its
prompt (the same tokens, later), never run on part of a state.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, fields

import torch

try:
    import xxhash
except ImportError:         # a runtime dependency; without it the host checksum falls back to zlib's CRC-32
    xxhash = None

from kestrel.models.kimi.step import CachePools
from kestrel.runtime.request import Request, RequestOutput, Status

PAGE_POOLS = ("mla",)                  # CachePools dicts indexed by page: a request's pages travel
SLOT_POOLS = ("conv", "recurrent")     # CachePools dicts indexed by slot: a request's slot travels
# CachePools dicts that hold no state (each MLA layer's page format): the handshake compares them, nothing moves
LAYOUT_ONLY = ("mla_format",)


class HandoffError(Exception):
    """A state that cannot be imported (wrong layout, corrupt bytes); the message names the cause."""


def pool_entries(pools: CachePools) -> list[tuple[str, int]]:
    """Every (pool, layer) tensor a request's state spans, in one canonical order. Every dict of CachePools must
    be a known page or slot pool: a new kind of pool added later fails here instead of being left behind."""
    names = [f.name for f in fields(pools) if isinstance(getattr(pools, f.name), dict)]
    unknown = sorted(set(names) - set(PAGE_POOLS) - set(SLOT_POOLS) - set(LAYOUT_ONLY))
    if unknown:
        raise HandoffError(f"CachePools has pools {unknown} that runtime/handoff.py does not transfer; add them to "
                           "PAGE_POOLS, SLOT_POOLS or LAYOUT_ONLY")
    return [(name, layer) for name in PAGE_POOLS + SLOT_POOLS for layer in sorted(getattr(pools, name))]


def pool_device(pools: CachePools) -> torch.device:
    for name in PAGE_POOLS + SLOT_POOLS:
        for t in getattr(pools, name).values():
            return t.device
    raise HandoffError("the cache pools hold no layers")


# the host checksum's default: xxh3-128 where xxhash imports (~8x zlib's CRC-32 on one core), else CRC-32
HOST_CHECKSUM = "xxh128" if xxhash is not None else "crc32"


def _host_bytes(buffer: torch.Tensor) -> memoryview:
    return memoryview((buffer if buffer.device.type == "cpu" else buffer.cpu()).numpy())


def checksum(buffer: torch.Tensor, manifest: dict, algo: str | None = None) -> str:
    """`ALGO:HEX`, a checksum of the bytes and the manifest, computed where the bytes are. On the host (the default
    there) xxh3-128 of the bytes (`xxh128`, where xxhash imports): a 128-bit hash mixing every byte with its
    position, so corruption that nobody crafted (a changed, lost or moved byte) passes with a chance of about
    2^-128, though with no proven bound like a CRC's; `crc32` (zlib) remains as the fallback: every error burst up
    to 32 bits caught, others but for 2^-32, at an eighth of the speed. On a device (`wsum`, the default there) the bytes are summed as int32 words twice, plainly
    and weighted by odd position factors, modulo 2^64: any single changed byte changes the weighted sum (an odd
    factor is invertible mod 2^64), with no copy to the host. The manifest goes through blake2b with the bytes'
    digest. None of these defends against a forger; they catch corruption."""
    algo = algo or (HOST_CHECKSUM if buffer.device.type == "cpu" else "wsum")
    n = buffer.numel()
    if algo == "xxh128":
        if xxhash is None:
            raise HandoffError("the state was checksummed with xxh128 but `xxhash` does not import here; "
                               "pip install xxhash (a kestrel dependency)")
        digest = f"{n}:{xxhash.xxh3_128_hexdigest(_host_bytes(buffer)) if n else 0}"
    elif algo == "crc32":
        digest = f"{n}:{zlib.crc32(_host_bytes(buffer)) if n else 0}"
    elif algo == "wsum":
        s0 = s1 = 0
        step = 1 << 24                       # words per chunk: bounds the int64 temporaries
        words = torch.cat([buffer, buffer.new_zeros((-n) % 4)]) if n % 4 else buffer
        words = words.view(torch.int32)
        for a in range(0, words.numel(), step):
            w = words[a:a + step].to(torch.int64)
            pos = torch.arange(a, a + w.numel(), device=w.device, dtype=torch.int64).mul_(2).add_(1)
            s0 += int(w.sum())
            s1 += int((w * pos).sum())
        digest = f"{n}:{s0 % 2 ** 64}:{s1 % 2 ** 64}"
    else:
        raise HandoffError(f"unknown checksum algorithm {algo!r}")
    h = hashlib.blake2b(json.dumps(manifest, sort_keys=True).encode(), digest_size=16)
    h.update(digest.encode())
    return f"{algo}:{h.hexdigest()}"


@dataclass
class PackedState:
    """A request's state as one flat uint8 buffer: `manifest` says what each byte range is."""
    manifest: dict          # {"num_tokens", "page_size", "num_pages", "entries": [[pool, layer, dtype, shape, off, n]]}
    buffer: torch.Tensor    # [nbytes] uint8
    checksum: str

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def export_state(pools: CachePools, req: Request, num_tokens: int, device: torch.device | str = "cpu") -> PackedState:
    """Copy the state of `req`'s first `num_tokens` tokens (its pages and its slot, every layer) into one buffer on
    `device` (the host for the ZMQ transport). Runs in the engine's thread, after the step that computed them."""
    ps = pools.page_size
    pages = req.pages[:-(-num_tokens // ps)]
    page_idx = torch.tensor(pages, dtype=torch.long, device=pool_device(pools))
    parts, entries, off = [], [], 0
    for name, layer in pool_entries(pools):
        t = getattr(pools, name)[layer]
        x = t.index_select(0, page_idx) if name in PAGE_POOLS else t[req.slot:req.slot + 1]
        raw = x.contiguous().view(-1).view(torch.uint8)
        parts.append(raw)
        entries.append([name, layer, str(t.dtype).replace("torch.", ""), list(x.shape), off, raw.numel()])
        off = -(-(off + raw.numel()) // 16) * 16       # each entry 16-byte aligned: its bytes view as its dtype
    # gathered where the pools are (on a GPU: device copies, queued on the engine's stream before anything can
    # reuse these pages), then one copy to `device`; a host buffer for pools on a GPU is pinned, which makes that
    # copy and the transport's reads of it run at DMA rate
    gathered = torch.zeros(off, dtype=torch.uint8, device=page_idx.device)
    for (_, _, _, _, o, n), raw in zip(entries, parts):
        gathered[o:o + n].copy_(raw)
    if gathered.device == torch.device(device):
        buffer = gathered
    elif torch.device(device).type == "cpu":
        buffer = host_buffer(off, pin=gathered.is_cuda).copy_(gathered)
    else:
        buffer = gathered.to(device)
    manifest = {"num_tokens": num_tokens, "page_size": ps, "num_pages": len(pages), "entries": entries}
    return PackedState(manifest, buffer, checksum(buffer, manifest))


def host_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialized uint8 host buffer; `pin` (for bytes on their way to or from a GPU): page-locked, from
    torch's caching host allocator, which reuses its blocks (no page faults, no cudaHostAlloc per request) and lets
    a non-blocking copy to the device run at DMA rate. Never pinned without CUDA, which would create a context."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())


def verify(state: PackedState) -> None:
    got = checksum(state.buffer, state.manifest, state.checksum.split(":", 1)[0])
    if got != state.checksum:
        raise HandoffError(f"the transferred state fails its checksum ({got} != {state.checksum}): bytes were "
                           "corrupted on the way")


def check_fits(pools: CachePools, manifest: dict) -> None:
    """The manifest's pools, layers, dtypes and shapes are this cache's (the handshake compared layouts already;
    this is the last line before bytes land in the pools)."""
    mine = pool_entries(pools)
    theirs = [(name, layer) for name, layer, *_ in manifest["entries"]]
    if mine != theirs:
        missing = sorted(set(mine) - set(theirs)) or sorted(set(theirs) - set(mine))
        raise HandoffError(f"the state's layers differ from this cache's: first difference {missing[:1] or theirs}")
    if manifest["page_size"] != pools.page_size:
        raise HandoffError(f"the state has page size {manifest['page_size']}, this cache {pools.page_size}")
    for name, layer, dtype, shape, _, _ in manifest["entries"]:
        t = getattr(pools, name)[layer]
        if str(t.dtype).replace("torch.", "") != dtype or list(t.shape[1:]) != shape[1:]:
            raise HandoffError(f"{name} layer {layer}: the state is {dtype} {shape[1:]}, this cache "
                               f"{t.dtype} {list(t.shape[1:])}")


def import_state(pools: CachePools, req: Request, state: PackedState) -> None:
    """Write a verified state into `req`'s pages (already grown to the state's tokens) and slot."""
    check_fits(pools, state.manifest)
    pages = req.pages[:state.manifest["num_pages"]]
    device = pool_device(pools)
    buf = state.buffer.to(device, non_blocking=True)
    page_idx = torch.tensor(pages, dtype=torch.long, device=device)
    for name, layer, dtype, shape, off, n in state.manifest["entries"]:
        t = getattr(pools, name)[layer]
        src = buf[off:off + n].view(t.dtype).view(shape)
        if name in PAGE_POOLS:
            t.index_copy_(0, page_idx, src)
        else:
            t[req.slot:req.slot + 1].copy_(src)


def admit_imported(engine, req: Request, state: PackedState, first_token: int, first_logprob=None,
                   cached_tokens: int = 0) -> list[RequestOutput]:
    """Under the engine lock, right after `req` was queued: give it a slot and pages, import the (verified)
    state and put it in the running batch with its first token, whose output is returned. When the engine has no
    room now, nothing is taken and `req` stays queued: it is then computed here from its prompt."""
    cache, sched = engine.cache, engine.scheduler
    n = state.manifest["num_tokens"]
    if n != len(req.prompt_token_ids):
        raise HandoffError(f"the state covers {n} tokens but the prompt has {len(req.prompt_token_ids)}")
    if len(sched.running) >= sched.max_num_seqs or not cache.acquire_slot(req):
        return []
    if not cache.grow(req, n):
        cache.release(req)
        return []
    try:
        import_state(cache.pools, req, state)
    except BaseException:
        cache.release(req)
        raise
    sched.waiting.remove(req)
    req.num_computed = n
    req.metrics.cached_tokens = cached_tokens        # the context server's prefix hit, for the usage block
    req.status = Status.RUNNING
    sched.running.append(req)
    return [engine._append(req, first_token, first_logprob)]
