"""One step of a drafter's token-by-token loop (DSpark's Markov head): the token of every row and its q."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import first, randn, rows_ok
from kestrel.kernels.sampling.draft_step import draft_step
from kestrel.sampling_params import GREEDY_BELOW

# a draw may land on the other side of a CDF step from the reference's when rounding moves u * total across it: the
# q mass strictly between the two tokens is then ~0 (fp32 exp sums in another order: ~1e-6 of the total)
DRAW_SLACK = 1e-5
DRAWS_MOVED_PER = 8       # at most one row in 8 may be drawn so (none in a cell of fewer rows)


class DraftStep(OpWrapper):
    """x = base + bias (bias None: base alone), rows r of [R, V]; a row with temperature[r] < 1e-5 is greedy (scale 1),
    else scale = temperature[r]; q = softmax(x / scale). tokens[r] = argmax x (lowest id on ties) on a greedy row,
    else the inverse-CDF draw with u[r] (the first id whose running q sum passes u[r] * sum q; never an id of zero
    q); probs[r] = q, or tokens[r]'s one-hot on a greedy row. Writes tokens [R] int64 and probs [R, V] fp32 (both may
    be strided views of a [R, K, ...] block), returns them. Triton kernels: kestrel/kernels/sampling/draft_step.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("probs: fp32 exp / sum of the same terms summed in another order: ~1e-6 rel -> rtol 1e-4, "
                 "atol 1e-9; greedy tokens exact; a drawn token equal, or (at most one row in 8) with q mass < 1e-5 "
                 "strictly between it and the reference's (u * total rounded across a CDF step)")
    WIDTHS = ("V", "bias")
    CELLS = (
        tiny("the tiny presets' drafters on the CPU: 3 rows (greedy and sampled) over their 1,024 ids, Markov bias",
             R=3, V=1024, bias=True),
        tiny("unit: 4 rows over 9,000 ids (three chunks, the last partial), no bias", R=4, V=9000, bias=False),
        gpu("K3 / Kimi Linear DSpark propose bs1: Markov step over the 163,840 vocabulary", R=1, V=163840, bias=True),
        gpu("K3 DSpark propose bs8: Markov step over 163,840", R=8, V=163840, bias=True),
        gpu("K3 DSpark propose bs32: Markov step over 163,840", R=32, V=163840, bias=True),
        gpu("K3 DSpark propose bs64: Markov step over 163,840", R=64, V=163840, bias=True),
        gpu("a DSpark drafter without the Markov head, bs8 over 163,840", R=8, V=163840, bias=False),
    )

    @staticmethod
    def raw_call(base, bias, temperature, u, tokens, probs):
        draft_step(base, bias, temperature, u, tokens, probs, GREEDY_BELOW)
        return tokens, probs

    @staticmethod
    def reference(base, bias, temperature, u, tokens, probs):
        x = base.float() + (bias.float() if bias is not None else 0.0)
        greedy = temperature < GREEDY_BELOW
        q = torch.softmax(x / torch.where(greedy, 1.0, temperature.float()).unsqueeze(1), dim=-1)
        cdf = q.double().cumsum(-1)
        V = x.shape[1]
        drawn = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        last = ((q > 0) * torch.arange(1, V + 1, device=q.device)).amax(-1) - 1
        tok = torch.where(greedy, x.argmax(-1), torch.minimum(drawn, last.clamp(min=0)))
        one_hot = torch.zeros_like(q).scatter_(1, tok.unsqueeze(1), 1.0)
        tokens.copy_(tok)
        probs.copy_(torch.where(greedy.unsqueeze(1), one_hot, q))
        return tokens, probs

    @staticmethod
    def widths(base, bias, temperature, u, tokens, probs):
        return {"V": base.shape[1], "bias": bias is not None}

    @staticmethod
    def is_valid(base, bias, temperature, u, tokens, probs):
        why = first(rows_ok(base, "base"), rows_ok(probs, "probs"),
                    rows_ok(bias, "bias") if bias is not None else None)
        if why:
            return why
        R, V = base.shape
        if base.dtype != torch.float32 or probs.dtype != torch.float32:
            return f"base and probs must be fp32, got {base.dtype} and {probs.dtype}"
        if bias is not None and (bias.shape != base.shape or bias.dtype != torch.float32):
            return f"bias must be fp32 {tuple(base.shape)}, got {bias.dtype} {tuple(bias.shape)}"
        if probs.shape != (R, V):
            return f"probs must be [{R}, {V}], got {tuple(probs.shape)}"
        if temperature.shape != (R,) or temperature.dtype != torch.float32 or not temperature.is_contiguous():
            return f"temperature must be a contiguous fp32 [{R}], got {temperature.dtype} {tuple(temperature.shape)}"
        if u.shape != (R,) or u.dtype != torch.float64:
            return f"u must be fp64 [{R}], got {u.dtype} {tuple(u.shape)}"
        if tokens.shape != (R,) or tokens.dtype != torch.int64:
            return f"tokens must be int64 [{R}], got {tokens.dtype} {tuple(tokens.shape)}"
        if V >= 2 ** 31:
            return f"V={V} does not fit the kernels' int32 ids"
        if overlaps(probs, base) or overlaps(probs, bias) or overlaps(tokens, probs):
            return "probs overlaps an input or tokens: the kernels read the logits again after writing tokens"
        return None

    @staticmethod
    def compare(out, ref):
        (tok, probs), (tok_ref, probs_ref) = out, ref
        tok, tok_ref = tok.cpu(), tok_ref.cpu()
        q = probs_ref.double().cpu()
        greedy = q.max(-1).values == 1.0
        if not torch.equal(tok[greedy], tok_ref[greedy]):
            raise AssertionError(f"DraftStep greedy tokens {tok[greedy].tolist()} != reference "
                                 f"{tok_ref[greedy].tolist()}")
        cdf = q.cumsum(-1)
        moved = torch.nonzero(tok != tok_ref).flatten().tolist()
        # rounding moves a draw for a few rows in a hundred at 163,840 ids (u within ~1e-7 of a step); a wrong draw
        # (an id off by one, another chunk) moves most rows
        if len(moved) > tok.shape[0] // DRAWS_MOVED_PER:
            raise AssertionError(f"DraftStep drew other tokens than the reference in rows {moved} of {tok.shape[0]}")
        for r in moved:
            lo, hi = sorted((int(tok[r]), int(tok_ref[r])))
            between = float(cdf[r, hi - 1] - cdf[r, lo])
            if between > DRAW_SLACK or float(q[r, int(tok[r])]) == 0.0:
                raise AssertionError(f"DraftStep row {r} drew {int(tok[r])}, the reference {int(tok_ref[r])}: "
                                     f"q mass {between:.3g} between them (slack {DRAW_SLACK})")
        # greedy rows' one-hots sit on equal tokens (checked above); a sampled row's q does not depend on its draw
        assert_close(probs, probs_ref, rtol=1e-4, atol=1e-9, what="DraftStep probs")

    @staticmethod
    def make_inputs(spec, device, generator):
        R, V, K = spec["R"], spec["V"], 3
        # rows of a [R, K, V] block (the propose's layout): strided by K * V; logits with a trained-like spread
        base = randn((R, K, V), generator, device, torch.float32, scale=3.0)[:, 1]
        bias = randn((R, V), generator, device, torch.float32, scale=0.5) if spec["bias"] else None
        temps = torch.tensor([(0.0, 0.7, 1.0, 1.3)[i % 4] for i in range(R)], dtype=torch.float32, device=device)
        if R == 1:
            temps.fill_(0.8)
        u = torch.rand((R, K), generator=generator, dtype=torch.float64).to(device)[:, 1]
        return dict(base=base, bias=bias, temperature=temps, u=u,
                    tokens=torch.full((R, K), -1, dtype=torch.int64, device=device)[:, 1],
                    probs=torch.full((R, K, V), -1.0, dtype=torch.float32, device=device)[:, 1])
