"""Kernel launches per layer of a decode step of each sm_90 target, at real widths, without a GPU.

The target is built on meta-device weights at the real preset's widths (contract.check_target_widths' harness)
and runs one decode step with every catalog entry recording (its reference answers on the meta device). A launch
is counted for
- each entry call, as many as the entry launches on sm_90 (`SM90_LAUNCHES`; the interpreter check below counts
  the same kernels for the entries whose CPU path is the GPU one), and
- each torch op the target or `catalog/_layers.py` runs itself outside an entry that launches a kernel
  (`cat`, `index_select`, copies; views and allocations launch nothing).
The counts are the numbers in docs/decode_launches.md; a change that adds a launch to a decode layer fails here.
The same step must not read a device value on the host (no `.item()`, no `nonzero`) outside an entry.
On a GPU, `test_gpu_decode_step_launches_the_counted_kernels` checks the same totals with torch.profiler over a
real decode step."""

from __future__ import annotations

import collections
import contextlib
import importlib
import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kestrel import contract
from kestrel.catalog import all_entries
from kestrel.catalog._op import LaunchLog
from kestrel.models.kimi.routing import load_claim

aten = torch.ops.aten

# target -> the real-width preset it runs (quantized targets: with the quantization_config their claim names)
TARGETS = {"kimi_linear_bf16__sm_90__default": "kimi-linear-48b", "kimi_k3_bf16__sm_90__default": "k3",
           "kimi_linear_nvfp4__sm_90__default": "kimi-linear-48b", "kimi_k3_mxfp4__sm_90__default": "k3",
           "kimi_k3_nvfp4__sm_90__default": "k3", "kimi_linear_mxfp4__sm_90__default": "kimi-linear-48b"}


def _mla_decode_launches(num_splits, **_):
    return 1 if num_splits == 1 else 2       # split-K: partial kernel + merge


def _w4a16_launches(x, packed, expert_offsets=None, sorted_token_ids=None, **_):
    """Two where the host splits the grouped decode GEMM over the one-row experts and the rest (w4a16.decode_path
    "split": batch 16-64 of both models), else one."""
    from kestrel.kernels.quant.w4a16 import decode_path
    S = sorted_token_ids.numel() if sorted_token_ids is not None else x.shape[0]
    split = expert_offsets is not None and x.dtype == torch.bfloat16 and decode_path(S, packed.shape[0]) == "split"
    return 2 if split else 1


# Kernels one call of an entry launches on sm_90. 1 for every entry that is one Triton kernel or one cuBLAS call.
SM90_LAUNCHES = {
    "Embedding": 1, "LmHead": 1, "Linear": 1, "HeadBmm": 1, "AddRmsNorm": 1, "AddMixRmsNorm": 1, "SiluGlu": 1,
    "SituGlu": 1, "SigmoidGate": 1, "KdaDecode": 1, "MlaNormCacheWrite": 1, "MlaDecode": _mla_decode_launches,
    "MoeRouterBf16": 2,          # one cuBLAS GEMM with fp32 output, one top-k kernel
    "MoePermuteSmall": 1, "MoeGroupedGemmGlu": 1, "MoeGroupedGemm": 1, "MoeCombine": 1, "MoeCombineRmsNorm": 1,
    # grouped decode never splits K at real widths: (rows / 16 + experts touched) x N / 32 tiles >= 2 x the SMs
    "W4A16GroupedGemm": _w4a16_launches, "W4A16GroupedGemmGlu": _w4a16_launches,
}
# entries whose CPU path differs from the sm_90 one (the router's GEMM runs as casts + an fp32 matmul on the CPU,
# the LM head likewise); their numbers above come from their raw_call's CUDA branch
CPU_DIFFERS = {"MoeRouterBf16", "LmHead"}

NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
             aten.new_empty_strided.default, aten.empty_like.default, aten.detach.default, aten.alias.default,
             aten.lift_fresh.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
             aten.chunk.default}
HOST_SYNCS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.item.default}


def _launches_kernel(func) -> bool:
    return not (getattr(func, "is_view", False) or func in NO_KERNEL)


class Counter(TorchDispatchMode):
    """Kernel launches per layer: entries by SM90_LAUNCHES, torch ops outside entries one each."""

    def __init__(self):
        super().__init__()
        self.depth = 0
        self.layer: int | str = "pre"
        self.counts: collections.Counter = collections.Counter()
        self.what: dict = collections.defaultdict(list)
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth == 0 and _launches_kernel(func):
            self.counts[self.layer] += 1
            self.what[self.layer].append(str(func))
            if func in HOST_SYNCS:
                self.syncs.append(f"layer {self.layer}: {func}")
        return func(*args, **(kwargs or {}))

    def entry(self, name: str, arguments: dict) -> None:
        if name not in SM90_LAUNCHES:
            raise AssertionError(f"{name} launched in a decode step: add its sm_90 launch count to SM90_LAUNCHES")
        n = SM90_LAUNCHES[name]
        n = n(**arguments) if callable(n) else n
        self.counts[self.layer] += n
        self.what[self.layer].append(f"{name} x{n}" if n != 1 else name)


class _Marked(list):
    """The target's layer list, telling the counter which layer the forward is in."""

    def __init__(self, items, counter: Counter):
        super().__init__(items)
        self.counter = counter

    def __iter__(self):
        for i, L in enumerate(list.__iter__(self)):
            self.counter.layer = i
            yield L
        self.counter.layer = "post"


@contextlib.contextmanager
def counting(counter: Counter):
    """Every entry's raw_call counts its launches and answers with its reference on the meta device."""
    log = LaunchLog()
    entries = all_entries()
    saved = {e: e.__dict__["raw_call"] for e in entries}

    def wrap(e):
        rec = log._recorder(e)
        sig = inspect.signature(e.reference)

        def launch(*args, **kwargs):
            counter.entry(e.__name__, dict(sig.bind(*args, **kwargs).arguments))
            counter.depth += 1
            try:
                return rec(*args, **kwargs)
            finally:
                counter.depth -= 1
        return launch

    for e in entries:
        setattr(e, "raw_call", staticmethod(wrap(e)))
    try:
        with counter:
            yield counter
    finally:
        for e, raw in saved.items():
            setattr(e, "raw_call", raw)


def decode_launches(target_name: str, layers: int):
    config = contract.claimed_config(TARGETS[target_name], load_claim(target_name), layers)
    model = contract._meta_model(config, torch.bfloat16)
    target = importlib.import_module(f"kestrel.models.kimi.targets.{target_name}.modeling").build(model, config)
    name, batch, pools = contract.launch_steps(config)[0]
    assert name == "decode"
    counter = Counter()
    target.layers = _Marked(target.layers, counter)
    with counting(counter):
        target(batch, pools)
    return config, counter


def _layer_name(config, i: int) -> str:
    return f"{config.layer_kinds[i]}+{'moe' if config.is_moe_layer(i) else 'dense'}"


# (layer kind + FFN kind) -> launches of one decode layer; see docs/decode_launches.md for each line
# FP4 experts: the GLU rides in W4A16GroupedGemmGlu's epilogue as in the bf16 targets, but Kimi Linear's bf16 shared
# expert cannot ride in the FP4 stacks as expert E (gate|up, SiLU-GLU, down, the add: 4 more)
EXPECTED = {
    "kimi_linear_bf16__sm_90__default": {"kda+dense": 9, "kda+moe": 12, "mla+moe": 15},
    "kimi_k3_bf16__sm_90__default": {"kda+dense": 9, "kda+moe": 15, "mla+moe": 22},
    "kimi_linear_nvfp4__sm_90__default": {"kda+dense": 9, "kda+moe": 16, "mla+moe": 19},
    "kimi_linear_mxfp4__sm_90__default": {"kda+dense": 9, "kda+moe": 16, "mla+moe": 19},
    "kimi_k3_mxfp4__sm_90__default": {"kda+dense": 9, "kda+moe": 15, "mla+moe": 22},
    "kimi_k3_nvfp4__sm_90__default": {"kda+dense": 9, "kda+moe": 15, "mla+moe": 22},
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_decode_launches_per_layer(target):
    # 5 layers: 0 KDA + dense, 1-2 KDA + MoE, 3-4 MLA + MoE (every fourth layer and the last are MLA)
    config, counter = decode_launches(target, 5)
    per_kind: dict[str, set[int]] = collections.defaultdict(set)
    for i in range(config.num_layers):
        per_kind[_layer_name(config, i)].add(counter.counts[i])
    got = {k: max(v) for k, v in per_kind.items()}
    detail = {_layer_name(config, i): counter.what[i] for i in range(config.num_layers)}
    assert got == EXPECTED[target], detail
    assert all(len(v) == 1 for v in per_kind.values()), per_kind     # layers of one kind launch alike
    if target == "kimi_linear_bf16__sm_90__default":
        assert got["kda+moe"] <= 12
    # outside the layers: StepPlan's kv lengths (add + cast) and slots cast and the embedding before; after, the
    # logits rows (index_select: two on Kimi Linear, one on K3), the final norm and the LM head (its memset + GEMM)
    assert counter.counts["pre"] <= 4 and counter.counts["post"] <= 5, (counter.what["pre"], counter.what["post"])
    assert counter.syncs == []


def _count_interpreted(fn) -> int:
    """Kernels a call launches under the Triton interpreter: Triton launches plus kernel-launching torch ops
    outside them."""
    from triton.runtime.interpreter import InterpretedFunction
    counter = Counter()
    real_run = InterpretedFunction.run

    def run(self, *args, **kwargs):
        counter.counts["triton"] += 1
        counter.depth += 1
        try:
            return real_run(self, *args, **kwargs)
        finally:
            counter.depth -= 1

    InterpretedFunction.run = run
    try:
        with counter:
            fn()
    finally:
        InterpretedFunction.run = real_run
    return sum(counter.counts.values())


@pytest.mark.parametrize("name", sorted(set(SM90_LAUNCHES) - CPU_DIFFERS))
def test_launch_table_matches_the_interpreter(name):
    """The table's count for each entry equals the kernels its raw_call launches on the CPU interpreter (Triton
    launches + torch kernel ops), on the entry's first CPU cell."""
    from kestrel.kernels import interpreting
    if not interpreting():
        pytest.skip("counts Triton launches under TRITON_INTERPRET=1")
    entry = next(e for e in all_entries() if e.__name__ == name)
    cell = next(c for c in entry.CELLS if "cpu" in c.archs)
    inputs = entry.make_inputs(cell.spec, "cpu", torch.Generator().manual_seed(0))
    want = SM90_LAUNCHES[name]
    want = want(**{**cell.spec, **inputs}) if callable(want) else want
    assert _count_interpreted(lambda: entry.raw_call(**inputs)) == want



def _on_device(batch, pools, device):
    """A CPU step of `launch_steps` and fresh pools of the same shapes on `device`."""
    import dataclasses
    moved = {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    on = dataclasses.replace(pools, mla={i: torch.zeros_like(t, device=device) for i, t in pools.mla.items()},
                             conv={i: torch.zeros_like(t, device=device) for i, t in pools.conv.items()},
                             recurrent={i: torch.zeros_like(t, device=device) for i, t in pools.recurrent.items()})
    return dataclasses.replace(batch, **moved), on


def _is_cublas(kernel: str) -> bool:
    return kernel.startswith(("nvjet", "cutlass")) or "gemm" in kernel.lower() and not kernel.startswith("_")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts the CUDA kernels of a real decode step")
@pytest.mark.parametrize("target,layers", [("kimi_linear_bf16__sm_90__default", 5), ("kimi_k3_bf16__sm_90__default", 2),
                                          ("kimi_linear_nvfp4__sm_90__default", 5),
                                          ("kimi_linear_mxfp4__sm_90__default", 5),
                                          ("kimi_k3_mxfp4__sm_90__default", 2)])
def test_gpu_decode_step_launches_the_counted_kernels(target, layers):
    """On a GPU, one eager decode step at real widths (random weights) launches exactly the kernels counted above
    (torch.profiler's CUDA kernel and memset events; copies from the host are not launches)."""
    from torch.profiler import ProfilerActivity, profile

    from kestrel.models.kimi.checkpoint import random_reference_model
    config, counter = decode_launches(target, layers)
    want = sum(counter.counts.values())
    dev = torch.device("cuda")
    target = importlib.import_module(f"kestrel.models.kimi.targets.{target}.modeling").build(
        random_reference_model(config, torch.bfloat16, dev, seed=0), config)
    _, batch, pools = contract.launch_steps(config)[0]
    batch, pools = _on_device(batch, pools, dev)
    target(batch, pools)                       # compiles the kernels
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        target(batch, pools)
        torch.cuda.synchronize()
    # cuBLAS may split K for a one-row GEMM (o_proj, down_proj: K >= 4x N on the H200) and then finishes the one
    # library call with its own reduce kernel: counted with its GEMM, as one `Linear` launch (H200, torch 2.11: 6
    # of the 78 kernels of the 5-layer Kimi Linear step were those reduces)
    # cuBLAS may also clear its output before some GEMMs (a memset right before the GEMM: the LM head's bf16 x bf16
    # -> fp32, and at K3 widths the dense down_proj and a W_UV HeadBmm): that too is part of the one library call
    events = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not e.name.startswith("Memcpy") and "splitKreduce_kernel" not in e.name]
    kernels = [k for i, k in enumerate(events)
               if not (k.startswith("Memset") and i + 1 < len(events) and _is_cublas(events[i + 1]))]
    if len(kernels) != want:        # the profile's kernels in order, beside the counted launches per layer
        print("\n".join(k[:90] for k in kernels))
        print("\n".join(f"{layer}: {what}" for layer, what in counter.what.items()))
    assert len(kernels) == want, (len(kernels), want)
