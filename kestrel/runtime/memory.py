"""How many pages and state slots the cache gets.

On a GPU: weights are loaded first, then `profile_memory` runs the largest step (a `max_num_batched_tokens`
prefill) and a decode step at the largest CUDA-graph bucket on a throwaway cache and measures their peaks over the
weights (the decode peak plus the graphs' shared logits buffer stands for the graphs' pool; with speculation the
largest padded verify step too, whose graphs share that pool, the verify logits buffer and a drafter's propose
graphs' draft distributions); the pools get what is
left of `gpu_memory_utilization` of the card after weights, activations and graphs, minus a reserve (default 1 GiB,
`--memory-reserve`) that `cap_allocator` keeps outside the caching allocator's cap for the driver, NCCL and
transfers made later. `budget_line` is the one log line of the split. On the CPU the pool is sized explicitly, in tokens (`kv_cache_tokens`) or
bytes (`kv_cache_bytes`), default 65536 tokens. Either way one budget covers every layer in the pools: the model's
MLA pages and KDA slots plus any extra layers: `extra_layers` (at the model's widths) and `extra_mla` (a DSpark
drafter's MLA layers, id -> latent width), whose share `describe` and `budget_line` name as the draft KV.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch

from kestrel.config import KDA, MLA, EngineConfig, ModelConfig
from kestrel.errors import ConfigError
from kestrel.models.kimi.step import CachePools, page_formats
from kestrel.quant.kv_cache import KvPageFormat
from kestrel.runtime import precompile

log = logging.getLogger("kestrel.memory")

DEFAULT_CPU_CACHE_TOKENS = 65536
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass
class CachePlan:
    num_pages: int
    num_slots: int
    num_snapshots: int
    page_size: int
    max_pages_per_seq: int
    bytes_per_page: int = 0
    bytes_per_slot: int = 0
    layout: str = ""                  # the page formats and KDA state dtype, e.g. "fp8 pages, bf16 KDA state"
    baseline_pages: int | None = None  # pages the same bytes hold as bf16 pages with fp32 KDA state
    draft_bytes_per_page: int = 0     # the part of bytes_per_page that a drafter's MLA layers take (extra_mla)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        """What the pools allocate: the plan's pages and slots plus the scratch page and slot (runtime/cache.py)."""
        return (self.num_pages + 1) * self.bytes_per_page + \
            (self.num_slots + self.num_snapshots + 1) * self.bytes_per_slot

    @property
    def draft_nbytes(self) -> int:
        """What the drafter's layers take of `nbytes` (their pages, the scratch page included)."""
        return (self.num_pages + 1) * self.draft_bytes_per_page

    def describe(self, config: ModelConfig | None = None) -> str:
        full_len = self.max_pages_per_seq * self.page_size
        at_full = min(self.num_slots, self.num_pages // max(self.max_pages_per_seq, 1))
        draft = f" (draft KV {_fmt_bytes(self.draft_nbytes)} of it)" if self.draft_bytes_per_page else ""
        line = (f"KV cache: {self.num_tokens} tokens ({self.num_pages} pages x {self.page_size}) + "
                f"{self.num_slots} KDA state slots (+{self.num_snapshots} prefix snapshots) = "
                f"{_fmt_bytes(self.nbytes)}{draft}: up to {self.num_slots} concurrent requests, "
                f"{at_full} at the full {full_len}-token context")
        if self.layout:
            line += f"; {self.layout}"
        if self.baseline_pages is not None and self.baseline_pages != self.num_pages:
            base_tokens = self.baseline_pages * self.page_size
            base_full = min(self.num_slots, self.baseline_pages // max(self.max_pages_per_seq, 1))
            line += (f": {self.num_tokens - base_tokens:+d} tokens ({self.num_tokens / max(base_tokens, 1):.2f}x) "
                     f"and {at_full - base_full:+d} requests at the full context against bf16 pages with fp32 "
                     f"KDA state in the same memory ({base_tokens} tokens, {base_full} requests)")
        return line

    def requests_by_memory(self, context: int) -> int:
        """How many requests of `context` tokens the plan's bytes hold, each with its KDA state slot and its pages,
        before `max_num_seqs` caps the slots (the memory side of "how many 8K requests fit")."""
        per_request = self.bytes_per_slot + -(-context // self.page_size) * self.bytes_per_page
        return self.nbytes // max(per_request, 1)

    @property
    def extra_tokens(self) -> int:
        """Tokens this plan holds beyond bf16 pages with fp32 KDA state in the same bytes (0 without a baseline)."""
        return 0 if self.baseline_pages is None else (self.num_pages - self.baseline_pages) * self.page_size


def cache_formats(config: ModelConfig, ec: EngineConfig, dtype: torch.dtype,
                  extra_layers: dict[int, str] | None = None) -> tuple[dict[int, KvPageFormat], torch.dtype]:
    """(page format per MLA layer, the extra (drafter) MLA layers' included, KDA recurrent state dtype) of the
    engine flags `--kv-cache-dtype`, `--kv-cache-dtype-layers` and `--kda-state-dtype`."""
    kinds = ec.mla_cache_dtypes(config)
    kinds.update({i: ec.kv_cache_dtype for i, k in (extra_layers or {}).items() if k == MLA})
    return page_formats(config, dtype, kinds), STATE_DTYPES[ec.kda_state_dtype]


def layer_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype,
                extra_layers: dict[int, str] | None = None, kv_formats: dict[int, KvPageFormat] | None = None,
                state_dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(bytes per page over every MLA layer, bytes per KDA state slot over every KDA layer), extra layers included.
    `kv_formats` (every MLA layer's, extra ones included) gives the page rows; default: plain rows in `dtype`."""
    extra = extra_layers or {}
    n_mla = len(config.mla_layers) + sum(1 for k in extra.values() if k == MLA)
    n_kda = len(config.kda_layers) + sum(1 for k in extra.values() if k == KDA)
    per_page = CachePools.bytes_per_page(config, page_size, dtype, num_layers=n_mla, kv_formats=kv_formats)
    return per_page, CachePools.bytes_per_slot(config, dtype, state_dtype, num_layers=n_kda)


def extra_mla_bytes(extra_mla: dict[int, int] | None, page_size: int, dtype: torch.dtype) -> int:
    """Bytes per page of a drafter's MLA layers (layer id -> latent width per token)."""
    return sum(extra_mla.values() if extra_mla else ()) * page_size * torch.empty((), dtype=dtype).element_size()


@dataclass
class MemoryProfile:
    """Bytes measured on the GPU before the pools are sized."""
    weights: int          # allocated before profiling: weights and the model's buffers
    activations: int      # peak of the largest step over the weights
    graphs: int           # estimate for the graphs' pool: the largest decode step's peak + the logits buffer (with
    #                       speculation: + what the largest verify step peaks over it + its logits buffer, and a
    #                       drafter's propose outputs)


def profile_memory(model, config: ModelConfig, ec: EngineConfig, dtype: torch.dtype, device: torch.device,
                   max_model_len: int) -> MemoryProfile | None:
    """Run the largest prefill and the largest decode step on a throwaway cache and measure them (CUDA only).
    The prefill also compiles the prefill kernels' Triton specializations before serving starts."""
    if device.type != "cuda":
        return None
    from kestrel.runtime.cache import HybridCache
    from kestrel.runtime.graphs import decode_buckets, max_verify_blocks
    from kestrel.runtime.inputs import StepInputs
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device)
    ps = ec.page_size
    T = max(1, min(ec.max_num_batched_tokens, max_model_len - 1))
    pages = -(-T // ps)
    kv_formats, state_dtype = cache_formats(config, ec, dtype)
    cache = HybridCache(config, pages, ps, 1, 0, pages, dtype, device, prefix_caching=False, kv_formats=kv_formats,
                        state_dtype=state_dtype)
    cache.block_tables[0, :pages] = torch.arange(pages, dtype=torch.int32, device=device)
    n = decode_buckets(ec.max_num_seqs)[-1]
    inputs = StepInputs(1, T, ps, pages, device)
    inputs.decode_padding(lambda b: n, n, cache.scratch_slot, cache.scratch_row)

    def peak(batch) -> tuple[int, torch.Tensor]:
        if precompile.active():          # its Triton variants compiled in parallel first (runtime/precompile.py)
            with precompile.dry_run():
                model(batch, cache.pools)
            precompile.wait("memory profile")
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = model(batch, cache.pools)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, out

    prefill, _ = peak(inputs.fill([0] * T, list(range(T)), [0, T], [0], [0], [T - 1], cache.block_tables, []))
    inputs.fill_padding(n)
    decode, logits = peak(inputs.decode_batch(n, cache.block_tables, 0, [max_model_len - 1] * n))
    graphs = decode + logits.numel() * logits.element_size()
    spec = ec.speculative_config
    if spec is not None and getattr(model, "supports_verify", False):
        # verify graphs share the pool: the largest verify step's peak over the decode one, plus its logits buffer
        R = 1 + spec.num_speculative_tokens
        most = max_verify_blocks(spec, ec.max_num_seqs, ec.max_num_batched_tokens)
        nv = next(b for b in decode_buckets(ec.max_num_seqs) if b >= most)       # the runner's largest verify bucket
        inputs.verify_padding(R, nv)
        inputs.fill_verify_padding(nv)
        verify, vlogits = peak(inputs.verify_batch(nv, cache.block_tables, 0, [max(0, max_model_len - R)] * nv))
        graphs += max(0, verify - decode) + vlogits.numel() * vlogits.element_size()
        del vlogits
        if spec.method == "dspark":      # the propose graphs' static q output [bucket, K, V] fp32 (their activations
            graphs += nv * spec.num_speculative_tokens * config.vocab_size * 4     # share the pool's verify peak)
    del cache, inputs, logits
    torch.cuda.empty_cache()
    return MemoryProfile(weights, prefill, graphs)


def limit_block_splitting(device: torch.device) -> None:
    """Blocks over 1 GiB are never split for smaller tensors (PyTorch's max_split_size_mb) unless the user set
    PYTORCH_CUDA_ALLOC_CONF: a target regrouping its weights frees the loaded tensors and allocates joined ones, and
    carving those from the freed blocks kept whole expert stacks reserved (the pools then did not fit the cap)."""
    if device.type != "cuda" or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    try:
        with warnings.catch_warnings():       # torch 2.11 names a newer spelling; this one works from 2.1 on
            warnings.simplefilter("ignore", FutureWarning)
            torch.cuda.memory._set_allocator_settings("max_split_size_mb:1024")
    except (AttributeError, RuntimeError) as e:          # a private torch API: never fatal
        log.warning("could not limit the allocator's block splitting: %s", e)


def cap_allocator(ec: EngineConfig, device: torch.device) -> None:
    """Cap the caching allocator at `gpu_memory_utilization` of the card minus the reserve, so the reserve stays
    free for allocations outside it (driver, NCCL, transfers)."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()   # the cap is per card
    total = torch.cuda.mem_get_info(index)[1]
    cap = int(total * ec.gpu_memory_utilization) - int(ec.memory_reserve_gib * 2 ** 30)
    torch.cuda.set_per_process_memory_fraction(max(cap, 0) / total, index)


def budget_line(profile: MemoryProfile | None, plan: CachePlan, graph_bytes: int, ec: EngineConfig) -> str:
    """The one log line of the GPU memory split (graphs: what the capture really took)."""
    draft = f" (draft KV {_fmt_bytes(plan.draft_nbytes)})" if plan.draft_bytes_per_page else ""
    if profile is None:
        return f"memory: pools {_fmt_bytes(plan.nbytes)}{draft} (CPU: sized explicitly)"
    return (f"memory: weights {_fmt_bytes(profile.weights)} / activations {_fmt_bytes(profile.activations)} / "
            f"graphs {_fmt_bytes(graph_bytes)} (planned {_fmt_bytes(profile.graphs)}) / pools "
            f"{_fmt_bytes(plan.nbytes)}{draft} / reserve {_fmt_bytes(ec.memory_reserve_gib * 2 ** 30)} outside the "
            f"allocator cap ({ec.gpu_memory_utilization:.0%} of the card)")


def plan_cache(config: ModelConfig, ec: EngineConfig, dtype: torch.dtype, device: torch.device,
               max_model_len: int, activation_peak: int = 0,
               extra_layers: dict[int, str] | None = None, graph_bytes: int = 0,
               extra_mla: dict[int, int] | None = None, mla_shards: int = 1) -> CachePlan:
    """`extra_layers`: more layers at the model's widths (id -> kind); `extra_mla`: a drafter's MLA layers (id ->
    latent width). Both come out of the same budget, and a page holds every layer's latents of its tokens.
    `mla_shards`: ranks a page's latents are spread over (Helix): one rank's share is what its memory holds."""
    page_size = ec.page_size
    slots = ec.max_num_seqs
    snapshots = slots if ec.enable_prefix_caching else 0
    formats, state_dtype = cache_formats(config, ec, dtype, extra_layers)
    per_page, per_slot = layer_bytes(config, page_size, dtype, extra_layers, formats, state_dtype)
    draft_per_page = extra_mla_bytes(extra_mla, page_size, dtype)
    per_page += draft_per_page
    per_page //= mla_shards
    states = (slots + snapshots + 1) * per_slot + per_page        # + the scratch slot and page
    if ec.kv_cache_tokens is not None:
        if ec.kv_cache_tokens < 1:
            raise ConfigError(f"--kv-cache-tokens {ec.kv_cache_tokens}: must be >= 1")
        pages = -(-ec.kv_cache_tokens // page_size)
    elif ec.kv_cache_bytes is not None or device.type != "cuda":
        budget = ec.kv_cache_bytes if ec.kv_cache_bytes is not None else (
            DEFAULT_CPU_CACHE_TOKENS // page_size * per_page + states)
        if budget < states + per_page:
            raise ConfigError(f"--kv-cache-bytes {budget}: the {slots + snapshots + 1} KDA state slots need "
                              f"{_fmt_bytes(states)} and one page {_fmt_bytes(per_page)}; give at least "
                              f"{states + per_page} bytes or lower --max-num-seqs")
        pages = (budget - states) // max(per_page, 1)
    else:
        free, total = torch.cuda.mem_get_info(device)
        cap = int(total * ec.gpu_memory_utilization) - int(ec.memory_reserve_gib * 2 ** 30)
        # headroom over the profile: the captured graphs came out near 3x their planned size on the H200 (224 MiB
        # for 81 planned) and the allocator's blocks fragment; without it the first prefill after start-up ran out
        # of memory by 128 MiB with the pools filling the rest of the cap
        headroom = max(2 * graph_bytes, 512 * 2 ** 20) + activation_peak // 4
        # what the process holds: the allocator's reserve after releasing its unused blocks (a block split for a
        # smaller tensor stays reserved; the cap counts reserved memory, so planning from `allocated` alone let
        # the pools' allocation fail after the targets regrouped their weights)
        torch.cuda.empty_cache()
        resident = max(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
        used = resident + activation_peak + graph_bytes + headroom
        budget = cap - used
        if budget <= states + per_page:
            raise ConfigError(f"no memory left for the KV cache: cap {cap / 2**30:.1f} GiB, weights + activations "
                              f"+ graphs {used / 2**30:.1f} GiB; raise --gpu-memory-utilization or lower "
                              "--max-num-seqs")
        pages = (budget - states) // per_page
    max_pages = -(-max_model_len // page_size)
    plan = CachePlan(int(pages), slots, snapshots, page_size, min(max_pages, int(pages)), per_page, per_slot,
                     draft_bytes_per_page=draft_per_page)
    kinds = sorted({f.kind for f in formats.values()})
    plan.layout = f"{'/'.join(kinds) or 'no'} pages, {ec.kda_state_dtype} KDA state"
    if set(kinds) & {"fp8", "nvfp4"} or state_dtype != torch.float32:      # a smaller cache was asked for
        # what the smaller pages and states buy: the same bytes as bf16 pages with fp32 KDA state
        base_formats = page_formats(config, dtype, {i: "bf16" for i in formats})
        base_page, base_slot = layer_bytes(config, page_size, dtype, extra_layers, base_formats)
        base_page = (base_page + draft_per_page) // mla_shards
        base_states = (slots + snapshots + 1) * base_slot + base_page
        plan.baseline_pages = max(int((plan.nbytes - base_states) // max(base_page, 1)), 0)
    return plan
