"""Token embedding lookup."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn

VOCAB = 163840      # the Kimi tokenizer's vocabulary (Kimi Linear and K3)


class Embedding(OpWrapper):
    """out[t] = weight[ids[t]]: ids int32/int64 [T], weight [V, H] -> [T, H] in weight's dtype.
    A torch gather (torch.index_select, i.e. F.embedding's kernel): a pure memory copy of T rows that the
    torch kernel already runs at bandwidth, so Kestrel writes no kernel of its own here."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "a gather copies bits: exact"
    WIDTHS = ("V", "H", "dtype")
    CELLS = (
        tiny("unit: 7 tokens from a 1000 x 64 table", T=7, V=1000, H=64, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs64: embed, vocab 163840 x hidden 2304", T=64, V=VOCAB, H=2304,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B prefill 8192: embed", T=8192, V=VOCAB, H=2304, dtype=torch.bfloat16),
        gpu("K3 decode bs1: embed, vocab 163840 x hidden 7168", T=1, V=VOCAB, H=7168, dtype=torch.bfloat16),
        gpu("K3 decode bs256: embed", T=256, V=VOCAB, H=7168, dtype=torch.bfloat16),
        gpu("K3 prefill 8192: embed", T=8192, V=VOCAB, H=7168, dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(ids, weight, out=None):
        if out is None:
            return torch.nn.functional.embedding(ids, weight)
        return torch.index_select(weight, 0, ids, out=out)

    @staticmethod
    def reference(ids, weight, out=None):
        return weight[ids.long()]

    @staticmethod
    def widths(ids, weight, out=None):
        return {"V": weight.shape[0], "H": weight.shape[1], "dtype": weight.dtype}

    @staticmethod
    def is_valid(ids, weight, out=None):
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            return "ids must be int32/int64 [T]"
        if weight.dim() != 2:
            return "weight must be [V, H]"
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
            return f"token ids outside the vocabulary [0, {weight.shape[0]})"
        if out is not None and (out.shape != (ids.numel(), weight.shape[1]) or out.dtype != weight.dtype
                                or overlaps(out, weight)):
            return "out must be [T, H] in weight's dtype, not overlapping weight"
        return None

    @staticmethod
    def compare(out, ref):
        if out.shape != ref.shape or out.dtype != ref.dtype or not torch.equal(out.cpu(), ref.cpu()):
            raise AssertionError(f"Embedding: {tuple(out.shape)} {out.dtype} differs from the gather")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, V, H = spec["T"], spec["V"], spec["H"]
        return dict(ids=torch.randint(0, V, (T,), generator=generator, dtype=torch.int32).to(device),
                    weight=randn((V, H), generator, device, spec["dtype"]))
