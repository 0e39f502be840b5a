"""Shared helpers for the foundation tests: tiny checkpoints (Kestrel presets and HF transformers models),
checkpoint rewriting (renames, shards, extra / missing tensors), and a hand-driven paged cache for StepBatch tests.

Everything here is deterministic given its seed; nothing is all-zero (weights are trained-like random values).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from kestrel.config import ModelConfig
from kestrel.models.kimi import load_reference_model
from kestrel.models.kimi.step import CachePools, StepBatch

_ROOT = tempfile.mkdtemp(prefix="kestrel-tests-")
atexit.register(shutil.rmtree, _ROOT, True)

PYTHON = sys.executable      # the interpreter running the tests: its environment has kestrel installed
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """The models under test are tiny: thread hand-offs cost more than the math (several times over when other
    processes share the cores). Import this fixture into a test module to run that module on one intra-op thread;
    the previous setting is restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def scratch_dir(name: str) -> str:
    """A fresh empty directory under this test session's scratch root."""
    path = tempfile.mkdtemp(prefix=name + "-", dir=_ROOT)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Kestrel-preset checkpoints

@functools.cache
def tiny_checkpoint(preset: str, layers: int | None = None, seed: int = 0) -> str:
    """A float32 checkpoint of a tiny preset (made once per session), with the demo tokenizer."""
    from kestrel.models.kimi.checkpoint import make_checkpoint
    out = os.path.join(_ROOT, f"{preset}-{layers}-{seed}")
    make_checkpoint(preset, out, layers=layers, seed=seed, dtype=torch.float32)
    return out


def load_model(path: str, dtype: torch.dtype = torch.float32):
    config = ModelConfig.from_dir(path)
    return config, load_reference_model(path, config, dtype, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------------------
# reading and rewriting checkpoints

def read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out: dict[str, torch.Tensor] = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, fn)))
    return out


def write_tensors(path: str, tensors: dict[str, torch.Tensor], num_shards: int = 1, index: bool = True) -> None:
    """Write `tensors` as `num_shards` safetensors files (names split round-robin in sorted order) and, when
    `index`, a model.safetensors.index.json mapping each tensor to its shard."""
    from safetensors.torch import save_file
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        fn = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::num_shards]}
        save_file(part, os.path.join(path, fn), metadata={"format": "pt"})
        weight_map.update({n: fn for n in part})
    if index:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def copy_checkpoint(src: str, name: str, transform=None, num_shards: int = 2, config_edit=None) -> str:
    """A copy of the checkpoint at `src` in a fresh directory: config and tokenizer files copied (config.json
    passed through `config_edit(dict) -> dict` if given), tensors passed through `transform(dict) -> dict` and
    re-sharded into `num_shards` files with an index."""
    dst = scratch_dir(name)
    for fn in os.listdir(src):
        if not fn.endswith(".safetensors") and fn != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, fn), os.path.join(dst, fn))
    if config_edit is not None:
        with open(os.path.join(dst, "config.json")) as f:
            raw = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config_edit(raw), f, indent=1)
    tensors = read_tensors(src)
    if transform is not None:
        tensors = transform(tensors)
    write_tensors(dst, tensors, num_shards)
    return dst


# ---------------------------------------------------------------------------------------------------------------
# HF transformers KimiLinearForCausalLM

# HF's kimi_linear module binds each of these at import time to fla's / causal-conv1d's GPU kernel when that package
# imports, else to its own plain-torch loop; the forward looks them up as module globals on every call.
_HF_KERNEL_FUNCS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                    "causal_conv1d_update")


@functools.cache
def force_hf_torch_kda() -> None:
    """Point HF's Kimi Linear KDA and short-conv calls at their plain-torch bodies (the functions the fallback
    decorator wraps, reached through `__wrapped__`), whether or not fla-core is installed: fla's Triton kernels
    need a GPU and round q, k to bf16, so the CPU parity tests must not pick them up. Once per process."""
    import inspect

    from transformers.models.kimi_linear import modeling_kimi_linear as hf
    for name in _HF_KERNEL_FUNCS:
        fn = getattr(hf, name)
        torch_fn = inspect.unwrap(fn)
        assert torch_fn is not fn, f"HF's {name} is no longer a kernel-fallback wrapper; the parity setup is stale"
        setattr(hf, name, torch_fn)


def hf_model(seed: int, **config_kwargs):
    """A KimiLinearForCausalLM of the given config with trained-like random weights (incl. the router's
    e_score_correction_bias buffer), in eval mode, fp32, on HF's plain-torch KDA path (`force_hf_torch_kda`)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    force_hf_torch_kda()
    kw = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    kw.update(config_kwargs)
    cfg = KimiLinearConfig(**kw)
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name:
                p.copy_((torch.rand(p.shape, generator=g) * 15 + 1).log())
            elif "dt_bias" in name:
                p.copy_(torch.rand(p.shape, generator=g) * 3 - 4)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        n_bias = 0
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
                n_bias += 1
    assert n_bias > 0, "HF model has no e_score_correction_bias buffers; the parity setup is stale"
    return model


def save_hf(model, name: str) -> str:
    out = scratch_dir(name)
    model.save_pretrained(out)
    return out


def moonshot_rename(tensors: dict[str, torch.Tensor], dense_layers: list[int]) -> dict[str, torch.Tensor]:
    """HF's save_pretrained writes the dense layers' MLP under `block_sparse_moe.`; Moonshot writes `mlp.`."""
    out = {}
    for name, t in tensors.items():
        for i in dense_layers:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                old = f"model.layers.{i}.block_sparse_moe.{proj}.weight"
                if name == old:
                    name = f"model.layers.{i}.mlp.{proj}.weight"
        out[name] = t
    return out


# ---------------------------------------------------------------------------------------------------------------
# driving the reference model by hand: a paged cache with scattered pages and slots

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


class PagedRequests:
    """Pages and KDA slots for `num_reqs` requests of at most `max_tokens` tokens each. Pages are a random
    permutation of the pool and slots are not 0..n-1, so a wrong block-table or slot lookup shows; the pools start
    full of random garbage (only the requests' own slots are reset, as the engine does)."""

    def __init__(self, config: ModelConfig, num_reqs: int, max_tokens: int, page_size: int = 4, seed: int = 0,
                 extra_slots: int = 2, dtype: torch.dtype = torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.config, self.page_size = config, page_size
        self.pages_per_req = math.ceil(max_tokens / page_size)
        num_pages = num_reqs * self.pages_per_req + 3
        num_slots = num_reqs + extra_slots
        self.pools = CachePools.allocate(config, num_pages, page_size, num_slots, dtype, "cpu")
        for t in list(self.pools.mla.values()) + list(self.pools.conv.values()) + list(self.pools.recurrent.values()):
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        perm = torch.randperm(num_pages, generator=g)[:num_reqs * self.pages_per_req]
        self.tables = perm.view(num_reqs, self.pages_per_req).to(torch.int32)
        self.slots = torch.randperm(num_slots, generator=g)[:num_reqs].tolist()
        self.spare_slots = [s for s in range(num_slots) if s not in self.slots]
        self.pools.reset_slots(self.slots)

    def batch(self, segments: list[tuple[int, list[int], int, int]], snapshots=()) -> StepBatch:
        """A StepBatch of segments (request r, all its tokens, start, end): tokens[start:end] of request r, with
        logits for every row."""
        tokens, positions, cu, ctx, slots, tables = [], [], [0], [], [], []
        for r, toks, a, b in segments:
            tokens += toks[a:b]
            positions += range(a, b)
            cu.append(cu[-1] + b - a)
            ctx.append(a)
            slots.append(self.slots[r])
            tables.append(self.tables[r])
        return StepBatch(token_ids=torch.tensor(tokens), positions=torch.tensor(positions), cu_seqlens=cu,
                         context_lens=ctx, slots=torch.tensor(slots), block_tables=torch.stack(tables),
                         logits_indices=torch.arange(cu[-1]), snapshots=list(snapshots))


def prefill_all_logits(model, config: ModelConfig, ids: list[int], page_size: int = 4, seed: int = 1) -> torch.Tensor:
    """Logits at every position of `ids`, one request alone, one-shot prefill."""
    cache = PagedRequests(config, 1, len(ids), page_size=page_size, seed=seed)
    return model(cache.batch([(0, ids, 0, len(ids))]), cache.pools)


def randomize_module(module: torch.nn.Module, seed: int, lower_bound_gate: bool = False) -> None:
    """Trained-like random values for every parameter of a reference (sub)module built with torch.empty."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                lo, hi = (0.5, 2.0) if lower_bound_gate else (1.0, 16.0)
                p.copy_((torch.rand(p.shape, generator=g) * (hi - lo) + lo).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 4 - 4)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


@contextlib.contextmanager
def host_syncs_raise():
    """Inside, torch's sync debug mode raises on any host sync it watches (stream / device synchronize, blocking
    copies, `.item()`, `.tolist()` of a device tensor); waiting on a CUDA event is not one of them."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def count_ahead_launches(engine) -> list[int]:
    """Wraps an engine's `_launch`: the one-item list counts the steps launched ahead of the previous step's
    bookkeeping (async scheduling)."""
    n = [0]
    launch = engine._launch

    def counted(reqs, prev, t0):
        n[0] += prev is not None
        return launch(reqs, prev, t0)
    engine._launch = counted
    return n


def step_without_host_sync(engine, scheduled, draft=None):
    """Build and run one step of `scheduled` with torch's sync debug mode raising on any host sync (CUDA): the
    block-table flush, the batch (with `draft`, the proposer's block of its verify entries) and the model call.
    Returns (batch, verify blocks, logits)."""
    with host_syncs_raise():
        engine.cache.flush_block_tables()
        batch, _, blocks = engine._build_batch(scheduled, draft)
        logits = engine.runner(batch)
    return batch, blocks, logits


# ---- Triton compiles (CUDA tests of "no JIT on the serving path") ---------------------------------------------
# the sampler's compiled variants per vocabulary: _stats_kernel x2 (TOP_K), _first_digit_kernel x1, _radix_kernel x3
# (D), and _proposal_kernel, _ahead_kernel, _decide_kernel x4 each (TOP_K x STAGE), _fallback_kernel x1
SAMPLER_VARIANTS = 19


def sampler_kernels() -> dict:
    """The Triton kernels of kernels/sampling/nucleus.py by name."""
    from kestrel.kernels.sampling import nucleus
    return {name: getattr(nucleus, name) for name in dir(nucleus) if name.endswith("_kernel")}


def forget_compiled_sampler_kernels() -> None:
    """Drop the sampler kernels' in-process compiled variants (earlier tests may have compiled them), so the next
    launch of each goes through Triton's compile path (and its post-compile hook) again."""
    for kernel in sampler_kernels().values():
        kernel.device_caches.clear()


@contextlib.contextmanager
def triton_compiles():
    """The names of the Triton kernels compiled inside the block (Triton's post-compile hook), as a list."""
    import triton
    names: list[str] = []
    hook = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: names.append(getattr(k.get("fn"), "name", "?"))
    try:
        yield names
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook


def compile_for_sm90(script: str, fp_fusion: bool = False) -> str:
    """Run `script` (Python that compiles Triton kernels for GPUTarget("cuda", 90, 32) and prints what it did) in a
    process without TRITON_INTERPRET, so Triton compiles for the H200 on a machine without a GPU; `fp_fusion` sets
    TRITON_DEFAULT_FP_FUSION=1 as a GPU run has it. Returns its stdout; a failed process fails the test with its
    stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if fp_fusion:
        env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([PYTHON, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
