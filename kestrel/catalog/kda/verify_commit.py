"""KDA speculative verify commit (replay): after a verify step, advance each verify block's conv state and recurrent
state over its accepted tokens only. The verify (KdaRecurrent with update=False, ShortConv on a copy of the conv
states) left the slots as they were and kept the blocks' conv inputs, g and beta; this entry replays the first
`accepted[b]` of them into the slot (keys and values recomputed by the conv in fp32, as KdaDecode computes them), so
a speculating request holds one KDA slot, not K + 1."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, overlaps, tiny
from kestrel.catalog.kda._common import batch_layout, check_batch, check_gates_and_state, close, randn, realistic_g
from kestrel.kernels.kda._common import triton_runs_on
from kestrel.kernels.kda.verify_commit import kda_verify_commit
from kestrel.ops.kda import commit_varlen

KLIN = dict(H=32, D=128)        # Kimi Linear 48B
K3 = dict(H=96, D=128)          # K3 tp1: 96 KDA heads of 128
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _accepted(n_req: int, block: int) -> tuple[int, ...]:
    """A spread of accepted counts over a batch of blocks: every count 1..block (1 = no draft accepted) occurs."""
    return tuple(1 + (i * 5) % block for i in range(n_req))


class KdaVerifyCommit(OpWrapper):
    """raw_call(x [T, 3*H*D] conv inputs (q|k|v channels, unit channel stride), weight [3*H*D, K] the conv weight,
    g [T, H, D] fp32, beta [T, H] fp32, conv_state [S, 3*H*D, K-1] (x's dtype), state [S, H, D, D] fp32,
    cu_seqlens int32 [B+1] (the blocks), slots int32 [B], accepted int32 [B] (0..block length)) -> (conv_state,
    state), updated in place: request b's recurrent state has run the delta rule over the keys and values
    silu(conv) of its first accepted[b] rows of x, and its conv state holds the last K-1 inputs of its old state
    followed by those rows."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("conv state: a copy of inputs, exact; recurrent state: fp32 conv (K=4 terms) and <= 9 steps of "
                 "D=128-term dot products identical up to reassociation -> rtol 1e-4, atol 1e-5 (KdaRecurrent's)")

    WIDTHS = ("H", "D", "dtype")
    CELLS = (
        tiny("Kimi Linear verify commit (tiny H=2 D=16): blocks of 5, 9, 3 tok, accepted 5, 1 (no draft), 0",
             lens=(5, 9, 3), accepted=(5, 1, 0), H=2, D=16, gate="kimi", dtype=torch.float32),
        tiny("K3 DSpark verify commit (tiny H=2 D=32, bf16): 4 blocks of 9 / 4 / 2 tok, accepted 9, 1, 3, 2",
             lens=(9, 9, 4, 2), accepted=(9, 1, 3, 2), H=2, D=32, gate="k3", dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 verify commit, K=8: 8 req x 9 tok, H=32 D=128", lens=(9,) * 8,
            accepted=_accepted(8, 9), **KLIN, gate="kimi", dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp1 verify commit, K=4: 64 req x 5 tok, H=32 D=128", lens=(5,) * 64,
            accepted=_accepted(64, 5), **KLIN, gate="kimi", dtype=torch.bfloat16),
        gpu("K3 tp1 DSpark verify commit, K=7: 8 req x 8 tok, H=96 D=128", lens=(8,) * 8,
            accepted=_accepted(8, 8), **K3, gate="k3", dtype=torch.bfloat16),
        gpu("K3 tp1 verify commit, K=8: 32 req x 9 tok, H=96 D=128", lens=(9,) * 32,
            accepted=_accepted(32, 9), **K3, gate="k3", dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(x, weight, g, beta, conv_state, state, cu_seqlens, slots, accepted):
        if triton_runs_on(x):
            return kda_verify_commit(x, weight, g, beta, conv_state, state, cu_seqlens, slots, accepted)
        return commit_varlen(x, weight, g, beta, conv_state, state, cu_seqlens, slots, accepted)

    @staticmethod
    def reference(x, weight, g, beta, conv_state, state, cu_seqlens, slots, accepted):
        return commit_varlen(x, weight, g, beta, conv_state, state, cu_seqlens, slots, accepted)

    @staticmethod
    def widths(x, weight, g, beta, conv_state, state, cu_seqlens, slots, accepted):
        return {"H": g.shape[1], "D": g.shape[2], "dtype": x.dtype}

    @staticmethod
    def is_valid(x, weight, g, beta, conv_state, state, cu_seqlens, slots, accepted):
        if g.dim() != 3:
            return f"g must be [T, H, D], got {tuple(g.shape)}"
        T, H, D = g.shape
        if D & (D - 1) or D < 16 or D > 256:
            return f"head dim D={D} must be a power of two in [16, 256]"
        if x.dtype not in _DTYPES or x.dim() != 2 or tuple(x.shape) != (T, 3 * H * D) or x.stride(1) != 1:
            return f"x must be a float [T={T}, 3*H*D={3 * H * D}] tensor with unit channel stride"
        if weight.dim() != 2 or weight.shape[0] != 3 * H * D or weight.shape[1] < 2 or not weight.is_contiguous() \
                or weight.dtype not in _DTYPES:
            return f"weight must be a contiguous float [{3 * H * D}, K >= 2] tensor"
        why = check_gates_and_state(g, beta, state, T, H, D)
        if why:
            return why
        S = state.shape[0]
        if conv_state.dim() != 3 or tuple(conv_state.shape) != (S, 3 * H * D, weight.shape[1] - 1) \
                or conv_state.stride(2) != 1:
            return f"conv_state must be [S={S}, {3 * H * D}, K-1={weight.shape[1] - 1}] with unit column stride"
        if conv_state.dtype != x.dtype:
            return f"conv_state dtype {conv_state.dtype} differs from x's {x.dtype}"
        for name, t in (("weight", weight), ("g", g), ("beta", beta), ("conv_state", conv_state),
                        ("state", state)):
            if t.device != x.device:
                return f"{name} is on {t.device}, x on {x.device}"
        why = check_batch(T, S, cu_seqlens, slots, x.device)
        if why:
            return why
        B = slots.numel()
        if not isinstance(accepted, torch.Tensor) or accepted.dtype != torch.int32 or tuple(accepted.shape) != (B,) \
                or accepted.device != x.device:
            return f"accepted must be an int32 [B={B}] tensor on {x.device}"
        cu, n = cu_seqlens.tolist(), accepted.tolist()
        if any(a < 0 or a > cu[b + 1] - cu[b] for b, a in enumerate(n)):
            return "accepted counts must lie in 0..block length"
        for pool in (conv_state, state):
            if any(overlaps(pool, t) for t in (x, weight, g, beta)):
                return "a state pool aliases an input"
        if overlaps(conv_state, state):
            return "conv_state aliases state"
        return None

    @staticmethod
    def compare(out, ref):
        close("KdaVerifyCommit conv_state pool", out[0], ref[0], rtol=0.0, atol=0.0)
        close("KdaVerifyCommit state pool", out[1], ref[1], rtol=1e-4, atol=1e-5)

    @staticmethod
    def make_inputs(spec, device, generator):
        """The layout the targets hand over: x rows gathered from the joined projection's output, the conv weight at
        nn.Conv1d's init scale, realistic decays through the model's gate, non-zero states in a pool with slots the
        call must leave alone."""
        H, D, dtype = spec["H"], spec["D"], spec["dtype"]
        C, KW = 3 * H * D, spec.get("K", 4)
        cu, slots, pool = batch_layout(spec["lens"], spec.get("pool"), generator, device)
        T = int(sum(spec["lens"]))
        bound = KW ** -0.5
        weight = ((torch.rand(C, KW, generator=generator) * 2 - 1) * bound).to(device=device, dtype=dtype)
        return dict(x=randn((T, C), generator, device, dtype), weight=weight,
                    g=realistic_g(T, H, D, spec.get("gate", "kimi"), generator, device),
                    beta=torch.sigmoid(torch.randn(T, H, generator=generator)).to(device),
                    conv_state=randn((pool, C, KW - 1), generator, device, dtype),
                    state=randn((pool, H, D, D), generator, device, torch.float32, scale=0.3),
                    cu_seqlens=cu, slots=slots,
                    accepted=torch.tensor(spec["accepted"], dtype=torch.int32, device=device))
