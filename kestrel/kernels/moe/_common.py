"""Small launch helpers shared by the MoE / norm / activation kernels."""

from __future__ import annotations

import triton



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
