"""What one model step reads: a flat batch of tokens from several requests, and the cache pools it updates.

The runtime builds a `StepBatch` per step (prefill chunks and decode tokens mixed, any order of requests) and owns
the `CachePools`; the reference implementation and every target read them the same way, so the paged cache and
the scheduler plug in without the model knowing about either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kestrel.config import ModelConfig
from kestrel.errors import ConfigError
from kestrel.quant.kv_cache import KvPageFormat, dtype_name


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


def page_formats(config: ModelConfig, dtype: torch.dtype, kinds: dict[int, str] | None = None
                 ) -> dict[int, KvPageFormat]:
    """The page format of every MLA layer from its KV cache dtype name (`EngineConfig.mla_cache_dtypes`; default
    auto everywhere): auto = the model dtype's plain format. A latent width a format cannot store is a
    ConfigError naming the flag."""
    kinds = kinds if kinds is not None else {i: "auto" for i in config.mla_layers}
    out = {}
    for i, kind in kinds.items():
        kind = dtype_name(dtype) if kind == "auto" else kind
        why = KvPageFormat.unsupported(kind, config.kv_lora_rank)
        if why:
            raise ConfigError(f"--kv-cache-dtype {kind} (layer {i}): {why}; use bf16 for this model")
        out[i] = KvPageFormat(kind, config.kv_lora_rank, config.qk_rope_head_dim)
    return out


@dataclass
class CachePools:
    """Per-layer tensors, keyed by the model's layer index: MLA latent pages for MLA layers, conv + recurrent
    state slots for KDA layers. Extra layers (a drafter's) are more keys in the same dicts. `mla_format[i]` says
    how layer i's page rows are stored (kestrel/quant/kv_cache.py: plain rows, or FP8 / NVFP4 bytes with their
    scales); a layer missing from it holds plain rows of its page dtype."""
    page_size: int
    mla: dict[int, torch.Tensor] = field(default_factory=dict)        # [num_pages, page_size, format width]
    conv: dict[int, torch.Tensor] = field(default_factory=dict)       # [num_slots, 3*H*D, K-1]
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)  # [num_slots, H, D, D] fp32 (or bf16)
    mla_format: dict[int, KvPageFormat] = field(default_factory=dict)

    @classmethod
    def allocate(cls, config: ModelConfig, num_pages: int, page_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str, layers: list[int] | None = None,
                 kv_formats: dict[int, KvPageFormat] | None = None,
                 state_dtype: torch.dtype = torch.float32,
                 extra_mla: dict[int, int] | None = None) -> "CachePools":
        """`kv_formats`: the page format per MLA layer (default: plain rows in the model dtype); `state_dtype`:
        the KDA recurrent state's (fp32, or bf16 for --kda-state-dtype bf16); `extra_mla`: more MLA layers (a
        drafter's; layer id -> latent width per token), plain rows of the model dtype, with the same page count
        and page size, read through the same block table."""
        pools = cls(page_size=page_size)
        formats = kv_formats or {}
        for i, width in sorted((extra_mla or {}).items()):
            if i < config.num_layers:
                raise ValueError(f"extra MLA layer {i} collides with the model's layers 0..{config.num_layers - 1}")
            pools.mla[i] = torch.zeros(num_pages, page_size, width, dtype=dtype, device=device)
        for i in (range(config.num_layers) if layers is None else layers):
            if config.layer_kinds[i] == "mla":
                pools.add_mla(i, formats.get(i) or page_formats(config, dtype, {i: "auto"})[i], num_pages, device)
            else:
                pools.conv[i] = torch.zeros(num_slots, 3 * config.kda_width, config.conv_kernel_size - 1,
                                            dtype=dtype, device=device)
                pools.recurrent[i] = torch.zeros(num_slots, config.kda_num_heads, config.kda_head_dim,
                                                 config.kda_head_dim, dtype=state_dtype, device=device)
        return pools

    def add_mla(self, i: int, fmt: KvPageFormat, num_pages: int, device: torch.device | str) -> None:
        self.mla[i] = fmt.allocate(num_pages, self.page_size, device)
        self.mla_format[i] = fmt

    def page_format(self, i: int) -> KvPageFormat | None:
        """Layer i's page format; None for pages made without one (plain rows of their dtype)."""
        return self.mla_format.get(i)

    def reset_slots(self, slots: list[int]) -> None:
        """A new request starts from zero state; slots are reused across requests."""
        if not slots or not self.conv:
            return
        dev = next(iter(self.conv.values())).device
        idx = torch.tensor(slots, dtype=torch.long)
        # through pinned memory on a GPU, without waiting: a plain upload from pageable memory waits for the
        # device (benchmarks/jit_probe.py counted it among an 8K prefill step's three host syncs); torch's caching
        # host allocator keeps the pinned block until the copy is done
        idx = idx.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else idx.to(dev)
        for t in list(self.conv.values()) + list(self.recurrent.values()):
            t.index_fill_(0, idx, 0)

    @staticmethod
    def bytes_per_page(config: ModelConfig, page_size: int, dtype: torch.dtype, num_layers: int | None = None,
                       kv_formats: dict[int, KvPageFormat] | None = None) -> int:
        """Bytes of one page over the MLA layers: `kv_formats` (one per layer) if given, else `num_layers` (default:
        the model's MLA layers) of plain rows in `dtype`."""
        if kv_formats is not None:
            return sum(page_size * f.row_bytes for f in kv_formats.values())
        n = len(config.mla_layers) if num_layers is None else num_layers
        return n * page_size * config.mla_cache_width * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32,
                       num_layers: int | None = None) -> int:
        """Bytes of one KDA state slot over `num_layers` KDA layers (default: the model's): conv state in the
        model dtype, recurrent state in `state_dtype`."""
        k = len(config.kda_layers) if num_layers is None else num_layers
        conv = 3 * config.kda_width * (config.conv_kernel_size - 1) * torch.empty((), dtype=dtype).element_size()
        rec = config.kda_num_heads * config.kda_head_dim ** 2 * torch.empty((), dtype=state_dtype).element_size()
        return k * (conv + rec)
