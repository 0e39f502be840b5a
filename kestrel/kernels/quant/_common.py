"""Launch helpers the quantized GEMMs share."""

from __future__ import annotations

import triton

from kestrel.kernels import interpreting

SM_COUNT = 132          # H100 SXM / H200


def split_k_plan(tiles: int, K: int, BK: int, split_k: int | None) -> tuple[int, int]:
    """(number of K splits, K extent of each, a multiple of BK). None picks one: enough splits that about two
    programs per SM stream the weights, each keeping at least 4 K steps; 1 under the interpreter."""
    steps = K // BK
    if split_k is None:
        split_k = 1 if interpreting() or tiles >= 2 * SM_COUNT else max(1, min(2 * SM_COUNT // tiles, steps // 4))
    per_split = triton.cdiv(steps, split_k) * BK
    return triton.cdiv(K, per_split), per_split
