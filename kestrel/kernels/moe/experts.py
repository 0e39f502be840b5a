"""Routed experts end to end: permute -> grouped GEMM (w13, gathering x by token) -> GLU -> grouped GEMM (w2)
-> weighted combine. Five launches of fixed-size buffers (S = T*k rows); no host sync, CUDA-graph capturable."""

from __future__ import annotations

import torch

from kestrel.kernels.activation.glu import glu
from kestrel.kernels.moe.combine import moe_combine
from kestrel.kernels.moe.grouped_gemm import grouped_gemm
from kestrel.kernels.moe.permute import moe_permute


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, act: str = "silu", beta: float = 4.0, linear_beta: float = 25.0,
                out: torch.Tensor | None = None) -> torch.Tensor:
    E = w13.shape[0]
    perm = moe_permute(topk_ids, E)
    gu = grouped_gemm(x, w13, perm.expert_offsets, sorted_token_ids=perm.sorted_token_ids)
    h = glu(gu, act, beta, linear_beta)
    y = grouped_gemm(h, w2, perm.expert_offsets)
    return moe_combine(y, topk_weights, perm.slot_to_sorted, out=out)
