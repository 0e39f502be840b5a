"""What one model step reads: a flat batch of tokens from several requests, and the cache pools it updates.

The runtime builds a `StepBatch` per step (prefill chunks and decode tokens mixed, any order of requests) and owns
the `CachePools`; the reference implementation and every target read them the same way, so the paged cache and
the scheduler plug in without the model knowing about either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kestrel.config import ModelConfig


@dataclass
class StepBatch:
    token_ids: torch.Tensor        # [T] int64, request b's tokens are token_ids[cu_seqlens[b]:cu_seqlens[b+1]]
    positions: torch.Tensor        # [T] int64, absolute position of each token in its request
    cu_seqlens: list[int]          # B+1 host offsets (host: the reference loops over segments)
    context_lens: list[int]        # B tokens already in the cache before this step (= first position)
    slots: torch.Tensor            # [B] int64 KDA state slot of each request
    block_tables: torch.Tensor     # [B, max_pages] int32 MLA pages of each request (-1 = unused)
    logits_indices: torch.Tensor   # [N] int64 rows of the flat batch that need logits
    # (segment b, slot s): after segment b, copy its KDA state into slot s (a prefix-cache snapshot at a page
    # boundary; a request's prompt is split into segments at the boundaries that need one)
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    host_slots: list[int] | None = None   # `slots` on the host, when the builder has them (saves a device sync)
    # Device index tensors the runtime's persistent inputs already hold, so a target's StepPlan uploads nothing
    # (None: it builds them from the host lists): int32 request of each token [T], cu_seqlens [B+1], cumulative
    # context + new tokens per segment [B+1].
    req_idx: torch.Tensor | None = None
    cu_seqlens_dev: torch.Tensor | None = None
    cu_kv_dev: torch.Tensor | None = None
    # the last `padded_rows` segments pad a decode step to a CUDA-graph bucket: one token each on the scratch slot
    # and scratch page (runtime/graphs.py); their logits rows are dropped
    padded_rows: int = 0
    # segments that are speculative verify blocks ([last token, drafts]): their KDA layers compute the block's
    # outputs from the state before it and leave the state slot untouched, keeping the block's per-token inputs until
    # the runtime calls the model's `commit_verify` with how many of its tokens were accepted (replay, one slot)
    verify_segments: tuple[int, ...] = ()

    @property
    def slot_list(self) -> list[int]:
        return self.host_slots if self.host_slots is not None else self.slots.tolist()

    @property
    def num_reqs(self) -> int:
        return len(self.cu_seqlens) - 1

    def seq_len(self, b: int) -> int:
        return self.cu_seqlens[b + 1] - self.cu_seqlens[b]


@dataclass
class CachePools:
    """Per-layer tensors, keyed by the model's layer index: MLA latent pages for MLA layers, conv + recurrent
    state slots for KDA layers. Extra layers (a drafter's) are more keys in the same dicts."""
    page_size: int
    mla: dict[int, torch.Tensor] = field(default_factory=dict)        # [num_pages, page_size, kv_lora + rope]
    conv: dict[int, torch.Tensor] = field(default_factory=dict)       # [num_slots, 3*H*D, K-1]
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)  # [num_slots, H, D, D] fp32

    @classmethod
    def allocate(cls, config: ModelConfig, num_pages: int, page_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str, layers: list[int] | None = None) -> "CachePools":
        pools = cls(page_size=page_size)
        for i in (range(config.num_layers) if layers is None else layers):
            if config.layer_kinds[i] == "mla":
                pools.mla[i] = torch.zeros(num_pages, page_size, config.mla_cache_width, dtype=dtype, device=device)
            else:
                pools.conv[i] = torch.zeros(num_slots, 3 * config.kda_width, config.conv_kernel_size - 1,
                                            dtype=dtype, device=device)
                pools.recurrent[i] = torch.zeros(num_slots, config.kda_num_heads, config.kda_head_dim,
                                                 config.kda_head_dim, dtype=torch.float32, device=device)
        return pools

    def reset_slots(self, slots: list[int]) -> None:
        """A new request starts from zero state; slots are reused across requests."""
        if not slots:
            return
        idx = torch.tensor(slots, device=next(iter(self.conv.values())).device) if self.conv else None
        for t in list(self.conv.values()) + list(self.recurrent.values()):
            t.index_fill_(0, idx, 0)

    @staticmethod
    def bytes_per_page(config: ModelConfig, page_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
        n = len(config.mla_layers) if num_layers is None else num_layers
        return n * page_size * config.mla_cache_width * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        k = len(config.kda_layers)
        conv = 3 * config.kda_width * (config.conv_kernel_size - 1) * torch.empty((), dtype=dtype).element_size()
        rec = config.kda_num_heads * config.kda_head_dim ** 2 * 4
        return k * (conv + rec)
