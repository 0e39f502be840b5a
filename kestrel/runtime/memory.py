"""How many pages and state slots the cache gets.

On a GPU: weights are loaded first, then one profiling step at the largest batch measures the activation peak; the
pools get what is left of `gpu_memory_utilization` of the card, minus a reserve (default 1 GiB) kept outside the
allocator for the driver and transfers. On the CPU the pool is sized explicitly, in tokens or bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kestrel.config import EngineConfig, ModelConfig
from kestrel.models.kimi.step import CachePools

log = logging.getLogger("kestrel.memory")

DEFAULT_CPU_CACHE_TOKENS = 65536


@dataclass
class CachePlan:
    num_pages: int
    num_slots: int
    num_snapshots: int
    page_size: int
    max_pages_per_seq: int

    def describe(self, config: ModelConfig) -> str:
        return (f"KV cache: {self.num_pages} pages x {self.page_size} tokens = {self.num_pages * self.page_size} "
                f"tokens, {self.num_slots} KDA state slots (+{self.num_snapshots} prefix snapshots): up to "
                f"{self.num_slots} concurrent requests")


def plan_cache(config: ModelConfig, ec: EngineConfig, dtype: torch.dtype, device: torch.device,
               max_model_len: int, activation_peak: int = 0) -> CachePlan:
    page_size = ec.page_size
    slots = ec.max_num_seqs
    snapshots = slots if ec.enable_prefix_caching else 0
    per_page = CachePools.bytes_per_page(config, page_size, dtype)
    per_slot = CachePools.bytes_per_slot(config, dtype)
    if ec.kv_cache_tokens is not None:
        pages = -(-ec.kv_cache_tokens // page_size)
    elif ec.kv_cache_bytes is not None or device.type != "cuda":
        budget = ec.kv_cache_bytes if ec.kv_cache_bytes is not None else (
            DEFAULT_CPU_CACHE_TOKENS // page_size * per_page + (slots + snapshots) * per_slot)
        pages = max(1, (budget - (slots + snapshots) * per_slot) // max(per_page, 1))
    else:
        free, total = torch.cuda.mem_get_info(device)
        cap = int(total * ec.gpu_memory_utilization) - int(ec.memory_reserve_gib * 2 ** 30)
        used = torch.cuda.memory_allocated(device) + activation_peak
        budget = cap - used
        states = (slots + snapshots) * per_slot
        if budget <= states + per_page:
            raise MemoryError(f"no memory left for the KV cache: cap {cap / 2**30:.1f} GiB, weights + activations "
                              f"{used / 2**30:.1f} GiB; raise --gpu-memory-utilization or lower --max-num-seqs")
        pages = (budget - states) // per_page
    max_pages = -(-max_model_len // page_size)
    return CachePlan(int(pages), slots, snapshots, page_size, min(max_pages, int(pages)))
