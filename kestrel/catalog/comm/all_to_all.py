"""All-to-all along the leading (row) dim: DEP's token dispatch / combine and Helix's exchange over heads."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, tiny
from kestrel.catalog.comm._group import cell_group, comm_ok, gather_exact, out_ok, rank_randn, result, row_width


def _rows(spec: dict, src: int, dst: int) -> int:
    """Rows rank `src` sends rank `dst` in a cell: C each, or for an uneven cell C minus 0..2 (empty sends too)."""
    return max(0, spec["C"] - (src + 2 * dst) % 3) if spec.get("uneven") else spec["C"]


class AllToAll(OpWrapper):
    """Rank r's x rows are cut in R consecutive chunks (`in_splits[j]` rows for rank j; None: equal chunks); rank r's
    out is the chunks every rank cut for r, in rank order (`out_splits[j]` rows from rank j; None: equal). DEP
    dispatches token rows to their experts' ranks and combines them back with it; Helix sends each rank's partial
    attention outputs of heads chunk j to rank j (x viewed [R*T, H/R*D]). Pure data movement: exact. The splits are
    host ints (a dispatch's counts are exchanged first). Returns out (allocated when None)."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "exact: a permutation of every rank's rows"
    WIDTHS = ("N", "dtype")
    CELLS = (
        tiny("unit: 3 rows x 40 bf16 to every rank (Helix's even exchange)", C=3, N=40, dtype=torch.bfloat16),
        tiny("unit: uneven fp32 splits, some empty (DEP dispatch)", C=2, N=24, dtype=torch.float32, uneven=True),
        gpu("K3 dep16 decode bs64 per rank: latent MoE dispatch / combine, 64 x 16 top-k rows of the 3584 latent "
            "spread over 16 ranks", C=64, N=3584, dtype=torch.bfloat16, uneven=True),
        gpu("K3 dep16 prefill chunk 8192 per rank: latent MoE dispatch, 8192 x 16 / 16 rows per peer", C=8192,
            N=3584, dtype=torch.bfloat16, uneven=True),
        gpu("K3 helix16 decode bs64: partial attention outputs, 96 / 16 heads x 512 latent per token and peer",
            C=64, N=3072, dtype=torch.bfloat16),
        gpu("K3 helix16 decode bs64: their log-sum-exps, 96 / 16 heads per token and peer (fp32)", C=64, N=6,
            dtype=torch.float32),
        gpu("K3 helix8 decode bs64: partial attention outputs, 96 / 8 heads x 512 latent", C=64, N=6144,
            dtype=torch.bfloat16),
        gpu("K3 helix8 decode bs64: their log-sum-exps, 96 / 8 heads (fp32)", C=64, N=12, dtype=torch.float32),
        gpu("Kimi Linear 48B dep4 decode bs64 per rank: MoE dispatch, 64 x 8 top-k rows of hidden 2304 over 4 "
            "ranks", C=128, N=2304, dtype=torch.bfloat16, uneven=True),
        gpu("Kimi Linear 48B helix2 decode bs64: partial attention outputs, 32 / 2 heads x 512 latent", C=64,
            N=8192, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B helix2 decode bs64: their log-sum-exps, 32 / 2 heads (fp32)", C=64, N=16,
            dtype=torch.float32),
    )

    @staticmethod
    def raw_call(x, group, out=None, in_splits=None, out_splits=None):
        if out is None:
            rows = sum(out_splits) if out_splits is not None else x.shape[0]
            out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def reference(x, group, out=None, in_splits=None, out_splits=None):
        R, me = group.size(), group.rank()
        splits = in_splits if in_splits is not None else [x.shape[0] // R] * R
        rows = sum(out_splits) if out_splits is not None else x.shape[0]

        def exchange():
            every_x = gather_exact(x, group)
            every_split = gather_exact(torch.tensor([splits], dtype=torch.float32, device=x.device), group)
            chunks = []
            for src in range(R):
                sent = [int(n) for n in every_split[src][0].tolist()]
                start = sum(sent[:me])
                chunks.append(every_x[src][start:start + sent[me]])
            return torch.cat(chunks)
        return result(x, out, (rows, *x.shape[1:]), exchange)

    @staticmethod
    def widths(x, group, out=None, in_splits=None, out_splits=None):
        return {"N": row_width(x), "dtype": x.dtype}

    @staticmethod
    def is_valid(x, group, out=None, in_splits=None, out_splits=None):
        why = comm_ok(x, "x", group)
        if why:
            return why
        R = group.size()
        for name, splits, rows in (("in_splits", in_splits, x.shape[0]),
                                   ("out_splits", out_splits, None if out is None else out.shape[0])):
            if splits is None:
                if rows is not None and rows % R:
                    return f"{name} None needs rows divisible by the group's {R} ranks, got {rows}"
                continue
            if len(splits) != R or any(int(n) != n or n < 0 for n in splits):
                return f"{name} must be {R} non-negative ints, got {list(splits)}"
            if rows is not None and sum(splits) != rows:
                return f"{name} sum to {sum(splits)} rows, the tensor has {rows}"
        if out is None and out_splits is None and in_splits is not None:
            return "uneven in_splits need out_splits (what the other ranks send is not known here)"
        return None if out is None else out_ok(out, x, (out.shape[0], *x.shape[1:]))

    @staticmethod
    def compare(out, ref):
        assert_close(out, ref, rtol=0, atol=0, what="AllToAll")

    @staticmethod
    def make_inputs(spec, device, generator):
        group = cell_group(device)
        R, me = group.size(), group.rank()
        in_splits = [_rows(spec, me, d) for d in range(R)]
        out_splits = [_rows(spec, s, me) for s in range(R)]
        x = rank_randn((sum(in_splits), spec["N"]), generator, group, device, spec["dtype"])
        if not spec.get("uneven"):
            return dict(x=x, group=group)
        return dict(x=x, group=group, in_splits=in_splits, out_splits=out_splits)
