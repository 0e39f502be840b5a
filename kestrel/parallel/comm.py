"""The collectives the reference model calls between ranks, over `torch.distributed` (gloo on CPUs, NCCL on GPUs).

Every function is the identity on one rank, so the reference model calls them unconditionally where its layout
needs them. All of them run over the default (world) group: in every layout Kestrel builds, the ranks that
exchange activations are the whole world (tp and helix: one attention group; dep: the MoE group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks (in place; returned for chaining). Partial sums are added in fp32 where x is a
    narrower float, so the reduction order does not cost more than one rounding."""
    if world() == 1:
        return x
    if x.dtype in (torch.bfloat16, torch.float16):
        y = x.float()
        dist.all_reduce(y)
        return x.copy_(y)
    dist.all_reduce(x)
    return x


def all_gather_rows(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Every rank's rows stacked in rank order (ranks may bring different counts, zero included), and the counts."""
    n = world()
    if n == 1:
        return x, [x.shape[0]]
    counts = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    every = [torch.empty_like(counts) for _ in range(n)]
    dist.all_gather(every, counts)
    sizes = [int(c) for c in every]
    top = max(sizes)
    padded = x.new_zeros((top,) + tuple(x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)]), sizes


def all_to_all_heads(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, ...] on every rank -> [R, T, H/R, ...]: rank r receives head block r from every rank (rank order)."""
    n = world()
    if n == 1:
        return x.unsqueeze(0)
    T, H = x.shape[0], x.shape[1]
    rest = tuple(x.shape[2:])
    send = x.reshape(T, n, H // n, *rest).movedim(1, 0).contiguous()       # [R, T, H/R, ...], block r for rank r
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv


def broadcast_object(obj, src: int = 0):
    """A picklable object from rank `src` to every rank (the lockstep driver's step message)."""
    if world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj, dst: int = 0) -> list | None:
    """Every rank's object on rank `dst` (rank order), None elsewhere."""
    if world() == 1:
        return [obj]
    box = [None] * world() if dist.get_rank() == dst else None
    dist.gather_object(obj, box, dst=dst)
    return box
