"""fla-core's chunked KDA (`fla.ops.kda.chunk_kda`) on the runtime's layouts: a flat varlen token batch split by
int32 `cu_seqlens`, and state pools indexed by `slots`.

fla-core is an optional dependency (`pip install kestrel[fla]`); it is imported on first use, after
`fla_tuning.prepare_fla_import` has pointed it at the kernel configs Kestrel ships for this GPU, if any. Its kernels
are autotuned Triton (the autotuner needs a GPU, so they do not run under the CPU interpreter) keyed on the head
count, head dims and dtypes, not on the token count: one warm-up call per (H, D) before serving keeps autotuning
off the serving path, and a shipped config (fla_configs/) keeps it out of start-up. fla takes one initial state
per sequence and returns one final state per sequence, so the wrapper gathers the slots' states before the call
and scatters the final states back after it (2 x B x H x D x D fp32 copies, small next to a prefill).
"""

from __future__ import annotations

import importlib.util

import torch

from kestrel.kernels.kda.fla_tuning import prepare_fla_import

FLA_HINT = "fla-core is not installed: pip install 'kestrel[fla]' (or fla-core>=0.6) to use the fla KDA prefill"


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def import_chunk_kda(device=None):
    """fla's `chunk_kda`, imported (the first time) with the shipped configs for `device`'s GPU in place."""
    prepare_fla_import(device)
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as e:            # the package or one of its own dependencies (einops) is missing
        raise ImportError(f"{FLA_HINT} ({e})") from e
    return chunk_kda


def fla_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                      out: torch.Tensor | None = None, fla_cu: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v [T, H, D] (model dtype), g [T, H, D] fp32 log decays, beta [T, H] fp32, state [S, H, D, D] fp32 pool
    ([D_k, D_v] per head), cu_seqlens int32 [B+1], slots int32 [B]. q and k are L2-normalized inside (fla's
    `use_qk_l2norm_in_kernel`, eps 1e-6 inside the sqrt) and q scaled by D^-0.5. Returns (o [T, H, D] in v's
    dtype, state with every slot's final state written back). `fla_cu` (StepPlan's waves give it): cu_seqlens as
    an int64 device tensor and an int64 host tensor, the same objects for every layer of a step. Without it fla
    derives its chunk indices from the device tensor, which reads it back (a device sync per layer)."""
    chunk_kda = import_chunk_kda(q.device)
    D = q.shape[-1]
    idx = slots.long()
    cu_long, cu_host = fla_cu if fla_cu is not None else (cu_seqlens.long(), None)
    with torch.no_grad():
        o, final = chunk_kda(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
            scale=D ** -0.5, initial_state=state.index_select(0, idx), output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu_long, cu_seqlens_cpu=cu_host)
    state.index_copy_(0, idx, final.to(state.dtype))
    o = o[0]
    if out is not None:
        out.copy_(o)
        return out, state
    return o.to(v.dtype), state
