"""Helix's exact merge of attention partials over KV shards (each rank's share of the MLA pages), by their LSEs."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import first, randn
from kestrel.kernels.attention.merge import merge_partials
from kestrel.ops.attention import merge_attention_partials

MAX_D = 1024          # a program holds one row of D in registers


class MergeAttentionPartials(OpWrapper):
    """out [T, H, D] = the attention over the union of R disjoint key shards, from outs [R, T, H, D] (each shard's
    normalized output) and lses [R, T, H] fp32 (its log-sum-exp; -inf: the shard saw no key, its row is ignored
    whatever it holds), in outs' dtype. After Helix's all-to-all over heads a rank holds, for its H/R heads, the
    partials of all R KV ranks: this merge makes them the unsharded attention. Reference:
    `ops.attention.merge_attention_partials`; Triton kernel: kestrel/kernels/attention/merge.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("a convex combination of the rows in fp32 (weights err ~R * 2^-24 rel), rounded once: bf16 out "
                 "2^-9 rel of |out| <= max |outs| ~ 4 -> rtol 1e-2, atol 1e-2; fp32 out rtol 1e-5, atol 1e-5")
    WIDTHS = ("R", "H", "D", "dtype")
    CELLS = (
        tiny("unit: 2 shards, 3 tokens x 4 heads x 32, one shard empty for some rows (NaN there)", R=2, T=3, H=4,
             D=32, dtype=torch.float32, empty=True),
        tiny("unit: 4 shards bf16, width not a power of two, rows no shard sees give 0", R=4, T=2, H=3, D=48,
             dtype=torch.bfloat16, empty=True, unseen=True),
        tiny("unit: 3 shards, every shard seen", R=3, T=4, H=2, D=16, dtype=torch.float32),
        gpu("K3 helix16 decode bs64: 96 / 16 heads x 512 latent per rank, 16 KV shards", R=16, T=64, H=6, D=512,
            dtype=torch.bfloat16, empty=True),
        gpu("K3 helix8 decode bs64: 96 / 8 heads x 512 latent per rank, 8 KV shards", R=8, T=64, H=12, D=512,
            dtype=torch.bfloat16, empty=True),
        gpu("K3 helix2 decode bs64: 48 heads x 512 latent per rank, 2 KV shards", R=2, T=64, H=48, D=512,
            dtype=torch.bfloat16, empty=True),
        gpu("K3 all 96 heads x 512 latent over 16 KV shards (a rank merging every head), bs1", R=16, T=1, H=96,
            D=512, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B helix2 decode bs64: 32 / 2 heads x 512 latent, 2 KV shards", R=2, T=64, H=16, D=512,
            dtype=torch.bfloat16, empty=True),
        gpu("Kimi Linear 48B helix4 decode bs64: 32 / 4 heads x 512 latent, 4 KV shards", R=4, T=64, H=8, D=512,
            dtype=torch.bfloat16, empty=True),
        gpu("Kimi Linear 48B all 32 heads x 512 latent over 4 KV shards, bs1", R=4, T=1, H=32, D=512,
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(outs, lses, out=None):
        return merge_partials(outs, lses, out=out)

    @staticmethod
    def reference(outs, lses, out=None):
        y = merge_attention_partials(outs, lses).to(outs.dtype if out is None else out.dtype)
        if out is not None:
            out.copy_(y)
            y = out
        return y

    @staticmethod
    def widths(outs, lses, out=None):
        R, _, H, D = outs.shape
        return {"R": R, "H": H, "D": D, "dtype": outs.dtype}

    @staticmethod
    def is_valid(outs, lses, out=None):
        if not isinstance(outs, torch.Tensor) or outs.dim() != 4:
            return "outs must be a [R, T, H, D] tensor"
        R, T, H, D = outs.shape
        why = first(None if outs.dtype in (torch.bfloat16, torch.float16, torch.float32) else
                    f"outs dtype {outs.dtype} unsupported",
                    None if outs.stride(-1) == 1 or D == 1 else "outs must have a contiguous last dim",
                    None if D <= MAX_D else f"D={D} > {MAX_D}: a program holds one row in registers",
                    None if isinstance(lses, torch.Tensor) and tuple(lses.shape) == (R, T, H) else
                    f"lses must be [{R}, {T}, {H}]",
                    None if lses.dtype == torch.float32 else f"lses must be fp32, got {lses.dtype}",
                    None if lses.device == outs.device else "lses and outs on different devices")
        if why or out is None:
            return why
        if tuple(out.shape) != (T, H, D) or (out.stride(-1) != 1 and D > 1):
            return f"out must be [{T}, {H}, {D}] with a contiguous last dim, got {tuple(out.shape)}"
        if overlaps(out, outs) or overlaps(out, lses):
            return "out overlaps an input"
        return None

    @staticmethod
    def compare(out, ref):
        tol = 1e-5 if ref.dtype == torch.float32 else 1e-2
        assert_close(out, ref, rtol=tol, atol=tol, what="MergeAttentionPartials")

    @staticmethod
    def make_inputs(spec, device, generator):
        R, T, H, D, dtype = spec["R"], spec["T"], spec["H"], spec["D"], spec["dtype"]
        outs = randn((R, T, H, D), generator, device, dtype)
        lses = randn((R, T, H), generator, device, torch.float32, scale=3.0)
        if spec.get("empty"):              # some shards saw no key: LSE -inf, the row left as garbage (NaN)
            empty = torch.rand((R, T, H), generator=generator) < 0.3
            empty[0] &= ~empty[1:].all(dim=0)                  # someone sees every row...
            if spec.get("unseen"):
                empty[:, 0, 0] = True                          # ...except row (0, 0), which no shard sees
            empty = empty.to(device)
            lses = lses.masked_fill(empty, float("-inf"))
            outs = outs.masked_fill(empty.unsqueeze(-1), float("nan"))
        return dict(outs=outs, lses=lses)
