"""Small launch helpers shared by the MoE / norm / activation kernels, and the grouped GEMMs' tile-to-expert map and
tile rows."""

from __future__ import annotations

import triton
import triton.language as tl



def pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(1, int(n))))


def warps_for(elems: int) -> int:
    """num_warps for a tile of `elems` register elements (about 16-32 elements per thread)."""
    if elems >= 16384:
        return 16
    if elems >= 4096:
        return 8
    if elems >= 1024:
        return 4
    return 2 if elems >= 256 else 1


@triton.jit
def tile_of_program(N, BN: tl.constexpr):
    """(M tile, N tile) of this program in a 1-D grid of M tiles x N tiles, the N tiles of one M tile adjacent:
    programs running together share their activation tiles through L2. With the M tiles adjacent instead (a
    (M, N) grid), an 8K-token prefill's wave of programs streams ~130 different 590 KB activation tiles, more than
    L2 holds, so every N tile re-read the whole gathered activation from HBM: 16 times 302 MB for Kimi Linear's
    w13, against the 2.4 GB of weights each GEMM must read once anyway."""
    nt = tl.cdiv(N, BN)
    pid = tl.program_id(0)
    return pid // nt, pid % nt


@triton.jit
def expert_tile(offs_ptr, E, pid_m, E_PAD: tl.constexpr, BM: tl.constexpr):
    """(expert, row end, tile start row) of grouped M tile pid_m over the expert offsets: each expert's rows in
    ceil(rows / BM) tiles, in expert order; expert >= E past the last tile (the caller returns). The grouped GEMMs
    (bf16, GLU-fused, W4A16) all map their tiles this way."""
    return expert_tile_sel(offs_ptr, E, pid_m, E_PAD, BM, 0)


@triton.jit
def expert_tile_sel(offs_ptr, E, pid_m, E_PAD: tl.constexpr, BM: tl.constexpr, SEL: tl.constexpr):
    """`expert_tile` over some of the experts: SEL 0 every expert, 1 only those holding exactly one row, 2 only
    those holding two or more (the W4A16 decode's split: the FMA kernel takes the one-row experts, the tensor-core
    one the rest, in two launches that write disjoint rows)."""
    ev = tl.arange(0, E_PAD)
    lo = tl.load(offs_ptr + ev, mask=ev < E, other=0)
    hi = tl.load(offs_ptr + ev + 1, mask=ev < E, other=0)
    tiles = (hi - lo + BM - 1) // BM
    if SEL == 1:
        tiles = tl.where(hi - lo == 1, tiles, 0)
    elif SEL == 2:
        tiles = tl.where(hi - lo >= 2, tiles, 0)
    ends = tl.cumsum(tiles, axis=0)
    e = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
    first_tile = tl.sum(tl.where(ev < e, tiles, 0), axis=0)
    row_lo = tl.sum(tl.where(ev == e, lo, 0), axis=0)
    row_hi = tl.sum(tl.where(ev == e, hi, 0), axis=0)
    return e, row_hi, row_lo + (pid_m - first_tile) * BM


@triton.jit
def tile_rows(rows_ptr, row0, row_hi, GATHER: tl.constexpr, BM: tl.constexpr):
    """A grouped GEMM tile's output rows in sorted order (rm), which are real (mmask), and the activation row each
    reads: the token id from rows_ptr when GATHER (the first GEMM reads x by token, no gathered copy), else rm."""
    rm = row0 + tl.arange(0, BM)
    mmask = rm < row_hi
    if GATHER:
        src = tl.load(rows_ptr + rm, mask=mmask, other=0)
    else:
        src = rm
    return rm, mmask, src
