"""Reading requests' cached latents out of the pages, for the expanded (prefill) form of MLA."""

from __future__ import annotations

from itertools import accumulate

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, tiny
from kestrel.catalog.moe._common import randn


class MlaGather(OpWrapper):
    """ctx[cu_k[b] + p] = kv_cache[block_tables[b, p // page], p % page] for p < kv_lens[b]: each request's
    latents in position order, flat [sum(kv_lens), W]. `row_index` [sum(kv_lens)] int64 is the flat page-row of
    each output row (built by `row_index_for`), so the copy is one torch index_select: a gather of whole
    contiguous rows, which torch's kernel does at copy bandwidth."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "a copy: exact"
    WIDTHS = ("page", "W", "dtype")
    CELLS = (
        tiny("unit: 3 requests crossing pages of 4, W=40", lens=(5, 1, 9), page=4, W=40, dtype=torch.float32),
        gpu("Kimi Linear / K3 prefill chunk over 8k context: 2 requests, W=576, page 64", lens=(8192, 2048),
            page=64, W=576, dtype=torch.bfloat16),
    )

    @staticmethod
    def row_index_for(block_tables, kv_lens: list[int], page_size: int, device) -> torch.Tensor:
        """The flat page-row of every gathered row (host lengths: the caller knows them, no device sync).
        A segment with no length reads no context here (a mixed step's decode row)."""
        segs = [(b, n) for b, n in enumerate(kv_lens) if n]
        if not segs:
            return torch.empty(0, dtype=torch.long, device=device)
        if len(segs) == 1:
            b, n = segs[0]
            p = torch.arange(n, device=device)
            return block_tables[b, p // page_size].long() * page_size + p % page_size
        # several segments in one set of launches (a loop over them launched four kernels a segment: 508 for an
        # 8K prompt cut at its 127 page boundaries for prefix-cache snapshots): each row's segment and its
        # position in that segment's context, from the segments' lengths uploaded once without a host sync
        lens = [n for _, n in segs]
        firsts = [0, *accumulate(lens)]
        total = firsts.pop()
        meta = torch.tensor([b for b, _ in segs] + firsts + lens, dtype=torch.long)
        meta = meta.to(device, non_blocking=True).view(3, len(segs))
        seg = torch.repeat_interleave(meta[0], meta[2], output_size=total)
        p = torch.arange(total, device=device) - torch.repeat_interleave(meta[1], meta[2], output_size=total)
        return block_tables[seg, p // page_size].long() * page_size + p % page_size

    @staticmethod
    def raw_call(kv_cache, row_index, out=None):
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        return torch.index_select(flat, 0, row_index, out=out) if out is not None else flat.index_select(0, row_index)

    @staticmethod
    def reference(kv_cache, row_index, out=None):
        ps = kv_cache.shape[1]
        return torch.stack([kv_cache[int(r) // ps, int(r) % ps] for r in row_index.tolist()]) if len(row_index) \
            else kv_cache.new_empty(0, kv_cache.shape[-1])

    @staticmethod
    def widths(kv_cache, row_index, out=None):
        return {"page": kv_cache.shape[1], "W": kv_cache.shape[2], "dtype": kv_cache.dtype}

    @staticmethod
    def is_valid(kv_cache, row_index, out=None):
        if not kv_cache.is_contiguous():
            return "kv_cache must be contiguous: rows are addressed flat"
        if row_index.dtype != torch.long:
            return "row_index must be int64"
        return None

    @staticmethod
    def compare(out, ref):
        assert_close(out, ref, rtol=0, atol=0, what="MlaGather")

    @staticmethod
    def make_inputs(spec, device, generator):
        lens, ps, W, dt = spec["lens"], spec["page"], spec["W"], spec["dtype"]
        pages_per = [-(-n // ps) for n in lens]
        num_pages = sum(pages_per) + 3
        perm = torch.randperm(num_pages, generator=generator)
        bt = torch.full((len(lens), max(pages_per)), -1, dtype=torch.int32)
        k = 0
        for b, n in enumerate(pages_per):
            bt[b, :n] = perm[k:k + n].to(torch.int32)
            k += n
        bt = bt.to(device)
        kv = randn((num_pages, ps, W), generator, device, dt)
        return dict(kv_cache=kv, row_index=MlaGather.row_index_for(bt, list(lens), ps, device))
