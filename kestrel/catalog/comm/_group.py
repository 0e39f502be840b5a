"""What the collective entries share: the process group a cell runs on, per-rank inputs, the references' exchange.

A collective's inputs include its `group` (a `torch.distributed.ProcessGroup`: the Mapping's tp / ep / helix group
in the model). A cell runs on `cell_group(device)`:
- inside `running_on(group)`: that group (the multi-rank tests spawn gloo ranks and run every cell on them);
- else, when `torch.distributed` is initialized, or this process is a torchrun rank (a certification run on
  several GPUs, see `_join_torchrun`): the world group;
- else a world-size-1 group of this process alone (gloo on the CPU, NCCL on a GPU), so `test_catalog_cells` drives
  the cells in one process like any other entry's, without initializing torch.distributed.

The references say what a collective computes from every rank's input. Each rank only holds its own, so a reference
first collects them all with `gather_exact` (all-gathers of fp32 copies: pure data movement, no arithmetic, exact in
any backend) and then computes the result in plain fp32 torch, in rank order, rounded once.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from kestrel.catalog._op import assert_close, overlaps
from kestrel.catalog.moe._common import randn

_LOCAL: dict[str, dist.ProcessGroup] = {}
_CURRENT: list[dist.ProcessGroup] = []
# torch 2.13 renamed the tensor forms of all-gather / reduce-scatter (the old names warn); the H200 runs 2.11
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
COMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def local_group(device: torch.device | str) -> dist.ProcessGroup:
    """A group of this process alone for the device's backend (made once per device type). torch builds groups
    only inside init_process_group, which would claim this process's default group for good; this is the same
    construction by hand (one backend registered on a ProcessGroup of size 1)."""
    dev = torch.device(device).type
    if dev not in _LOCAL:
        store = dist.HashStore()
        kind = dist.ProcessGroup.BackendType.NCCL if dev == "cuda" else dist.ProcessGroup.BackendType.GLOO
        backend = (dist.ProcessGroupNCCL if dev == "cuda" else dist.ProcessGroupGloo)(store, 0, 1)
        group = dist.ProcessGroup(store, 0, 1)
        group._set_default_backend(kind)
        group._register_backend(torch.device(dev), kind, backend)
        _LOCAL[dev] = group
    return _LOCAL[dev]


@contextlib.contextmanager
def running_on(group: dist.ProcessGroup):
    """Cells made inside the block run on `group`."""
    _CURRENT.append(group)
    try:
        yield group
    finally:
        _CURRENT.pop()


def cell_group(device: torch.device | str) -> dist.ProcessGroup:
    if _CURRENT:
        return _CURRENT[-1]
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        _join_torchrun(device)
    if dist.is_initialized():
        return dist.group.WORLD
    return local_group(device)


def _join_torchrun(device: torch.device | str) -> None:
    """Under torchrun (`torchrun --nproc-per-node 8 -m pytest tests/test_catalog_cells.py -k comm`) the cells run
    on all its ranks: this process takes its own GPU and joins the world group."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")


def rank_generator(gen: torch.Generator, group: dist.ProcessGroup) -> torch.Generator:
    """A generator of this rank's own inputs: every rank draws the same seed from the cell's generator and folds in
    its rank, so ranks hold different data and a rerun holds the same."""
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    return torch.Generator().manual_seed(seed + 7919 * group.rank())


def rank_randn(shape, gen, group, device, dtype):
    return randn(shape, rank_generator(gen, group), device, dtype)


def gather_exact(x: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's `x` (any first-dim length, same trailing shape), in rank order, as fp32 tensors on x's device."""
    R = group.size()
    if R == 1:
        return [x.float().clone()]
    n = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    sizes = [torch.empty_like(n) for _ in range(R)]
    dist.all_gather(sizes, n, group=group)
    rows = [int(s) for s in sizes]
    padded = torch.zeros((max(rows), *x.shape[1:]), dtype=torch.float32, device=x.device)
    padded[:x.shape[0]] = x.float()
    parts = [torch.empty_like(padded) for _ in range(R)]
    dist.all_gather(parts, padded, group=group)
    return [p[:r] for p, r in zip(parts, rows)]


def fp32_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum over ranks in fp32, rank 0 first."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


def comm_ok(x: torch.Tensor, name: str, group) -> str | None:
    """A tensor a collective may take: contiguous (NCCL and gloo read flat buffers), a float dtype they reduce."""
    if not isinstance(group, dist.ProcessGroup):
        return f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}"
    if not isinstance(x, torch.Tensor):
        return f"{name} must be a tensor"
    if x.dim() < 1:
        return f"{name} must have a leading row dim"
    if not x.is_contiguous():
        return f"{name} must be contiguous: collectives move flat buffers"
    if x.dtype not in COMM_DTYPES:
        return f"{name} dtype {x.dtype} unsupported (one of {', '.join(str(d) for d in COMM_DTYPES)})"
    return None


def out_ok(out: torch.Tensor | None, x: torch.Tensor, shape) -> str | None:
    """An `out=` a collective may write: x's dtype, `shape`, contiguous, apart from x."""
    if out is None:
        return None
    if tuple(out.shape) != tuple(shape) or out.dtype != x.dtype or not out.is_contiguous():
        return f"out must be contiguous {x.dtype} {tuple(shape)}, got {out.dtype} {tuple(out.shape)}"
    if overlaps(out, x):
        return "out overlaps x"
    return None


def result(x: torch.Tensor, out: torch.Tensor | None, shape, compute) -> torch.Tensor:
    """A reference's answer of `shape` in x's dtype from `compute()` (fp32), written into `out` when given; on the
    meta device (the contract's launch log) only shaped, with no exchange."""
    if x.is_meta:
        return out if out is not None else torch.empty(shape, dtype=x.dtype, device="meta")
    y = compute().to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def row_width(x: torch.Tensor) -> int:
    """Elements per leading-dim row: the width a collective's cell is matched on (rows are tokens)."""
    n = 1
    for d in x.shape[1:]:
        n *= d
    return n



def compare_sum(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """A sum over ranks against its fp32 reference. The backend adds in the tensor's dtype, rounding each of the
    R - 1 partial sums (R <= 16) to half an ulp: bf16 2^-9, fp16 2^-11 of a partial sum, itself at most a few times
    the result's rms for N(0, 1) parts -> rtol = atol / rms = 2^-6 (bf16), 2^-8 (fp16), 1e-5 (fp32)."""
    tol = {torch.bfloat16: 2 ** -6, torch.float16: 2 ** -8}.get(ref.dtype, 1e-5)
    rms = float(ref.float().pow(2).mean().sqrt()) if ref.numel() else 1.0
    assert_close(out, ref, rtol=tol, atol=tol * max(rms, 1e-6), what=what)
