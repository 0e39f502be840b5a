"""The KDA short conv (ShortConv) of a prefill on the GPU: both output layouts against the kernel it replaced, same
inputs, same run.

Shapes: T = 8192 tokens, C = 12288 (Kimi Linear 48B) and 36864 (K3 tp1) channels, one segment and 8, bf16, x a row
view of the joined KDA projection as the model gives it. Per shape: the median of 50 CUDA-event timings of
`short_conv` (its two launches) with out [T, C] (parts=1) and with q, k, v planes [3, T, W] (parts=3), the
replaced conv kernel (main before this change: 32 x 128 tiles, a masked load a tap, the state read per element),
and the three `.contiguous()` copies of the q, k, v column views that the planes make unnecessary. Bandwidth counts
x read once and out written once (the floor: 4 bytes a value). Outputs are checked against ShortConv.reference.

Run on the H200 from the repo root:
    PYTHONPATH=$PWD python3 benchmarks/short_conv_bench.py [--json benchmarks/results/short_conv_h200.json]
        [--sweep]    # also time other (rows a program, channels a program) tiles for the planes at C=12288
Prints a table and writes JSON {machine, command, records}.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from _results import median_ms, write_results

from kestrel.catalog.kda.conv import ShortConv
from kestrel.kernels.kda import conv as K
from kestrel.kernels.kda._common import _sum_combine

T = 8192
DEVICE = "cuda"
SHAPES = [  # (C, row stride of the joined projection, segments, why)
    (12288, 12576, 1, "Kimi Linear 48B: one 8K prompt"),
    (12288, 12576, 8, "Kimi Linear 48B: 8 x 1K prompts"),
    (36864, 49376, 1, "K3 tp1: one 8K prompt"),
    (36864, 49376, 8, "K3 tp1: 8 x 1K prompts"),
]


# ---- the baseline: the conv kernel this change replaced (kestrel/kernels/kda/conv.py at 8544eb4), kept here only
# so that the ratio is measured in the same run
@triton.jit(do_not_specialize=["T", "B"])
def _replaced_fwd_kernel(x_ptr, w_ptr, state_ptr, out_ptr, cu_ptr, slots_ptr, T, C, B,
                         stride_x_t, stride_o_t, stride_s_slot, stride_s_c,
                         KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BLOCK_B: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mt, mc = t < T, c < C
    ob = tl.arange(0, BLOCK_B)
    ends = tl.load(cu_ptr + 1 + ob, mask=ob < B, other=2147483647)
    b = tl.minimum(tl.reduce((ends[None, :] <= t[:, None]).to(tl.int32), 1, _sum_combine), B - 1)
    start = tl.load(cu_ptr + b, mask=mt, other=0)
    slot = tl.load(slots_ptr + b, mask=mt, other=0).to(tl.int64)
    t64 = t.to(tl.int64)
    acc = tl.full([BT, BC], 0.0, tl.float32)
    for j in tl.static_range(KW):
        p = t - (KW - 1) + j
        in_seg = p >= start
        xv = tl.load(x_ptr + (t64 - (KW - 1) + j)[:, None] * stride_x_t + c[None, :],
                     mask=(mt & in_seg)[:, None] & mc[None, :], other=0.0)
        col = (KW - 1) + (p - start)
        sv = tl.load(state_ptr + slot[:, None] * stride_s_slot + c[None, :] * stride_s_c + col[:, None],
                     mask=(mt & (~in_seg))[:, None] & mc[None, :], other=0.0)
        w = tl.load(w_ptr + c * KW + j, mask=mc, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    y = acc / (1.0 + tl.exp(-tl.maximum(acc, -88.0)))
    tl.store(out_ptr + t64[:, None] * stride_o_t + c[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


def replaced_conv(x, weight, conv_state, cu, slots, out):
    C, B = x.shape[1], slots.shape[0]
    _replaced_fwd_kernel[(triton.cdiv(T, 32), triton.cdiv(C, 128))](
        x, weight, conv_state, out, cu, slots, T, C, B, x.stride(0), out.stride(0), conv_state.stride(0),
        conv_state.stride(1), KW=weight.shape[1], BT=32, BC=128, BLOCK_B=max(16, triton.next_power_of_2(B)),
        num_warps=4)
    return out


def time_us(fn, reps: int) -> float:
    """Median of `reps` CUDA-event timings of fn() in us, after two untimed calls (compile, caches)."""
    return median_ms(fn, reps, warmup=2) * 1e3


def inputs(C: int, row: int, segments: int):
    gen = torch.Generator().manual_seed(C + segments)
    spec = dict(lens=(T // segments,) * segments, H=C // 384, D=128, dtype=torch.bfloat16, x_pad=row - C)
    return ShortConv.make_inputs(spec, torch.device(DEVICE), gen)


def run_shape(C: int, row: int, segments: int, why: str, reps: int) -> list[dict]:
    inp = inputs(C, row, segments)
    x, w, st, cu, slots = (inp[k] for k in ("x", "weight", "conv_state", "cu_seqlens", "slots"))
    W = C // 3
    gbytes = 2 * T * C * x.element_size() / 1e9          # x read once, out written once
    ref, _ = ShortConv.reference(x, w, st.clone(), cu, slots)
    ref = ref.float()
    records = []
    for parts in (1, 3):
        y, _ = K.short_conv(x, w, st.clone(), cu, slots, parts=parts)
        got = y.float() if parts == 1 else y.transpose(0, 1).reshape(T, C).float()
        err = ((got - ref).abs() / (ref.abs() + 1e-2)).max().item()      # bf16 output: about 2^-8
        scratch = st.clone()
        out = torch.empty_like(y)
        us = time_us(lambda: K.short_conv(x, w, scratch, cu, slots, out=out, parts=parts), reps)
        rec = dict(kernel="short_conv", why=why, tokens=T, channels=C, segments=segments, parts=parts,
                   dtype="bf16", x_row_stride=row, us=us, tb_s=gbytes * 1e3 / us, max_rel_err_vs_ref=err)
        if parts == 1:
            old = torch.empty_like(y)
            replaced_conv(x, w, st.clone(), cu, slots, old)
            rec["replaced_max_abs_diff"] = (old.float() - y.float()).abs().max().item()
            rec["replaced_us"] = time_us(lambda: replaced_conv(x, w, scratch, cu, slots, old), reps)
            rec["speedup_vs_replaced"] = rec["replaced_us"] / us
            views = y.split(W, dim=-1)
            rec["qkv_copies_us"] = time_us(lambda: [v.contiguous() for v in views], reps)
        records.append(rec)
    return records


def sweep(reps: int) -> list[dict]:
    """The planes at C=12288, one segment, for other conv tiles (module constants, restored after)."""
    C, row = 12288, 12576
    inp = inputs(C, row, 1)
    x, w, st, cu, slots = (inp[k] for k in ("x", "weight", "conv_state", "cu_seqlens", "slots"))
    saved = K.CONV_ROWS, K.CONV_BC
    records = []
    try:
        for rows in (16, 32, 64):
            for bc in (256, 512, 1024, 2048):
                K.CONV_ROWS, K.CONV_BC = rows, bc
                out = torch.empty(3, T, C // 3, dtype=x.dtype, device=x.device)
                us = time_us(lambda: K.short_conv(x, w, st, cu, slots, out=out, parts=3), reps)
                records.append(dict(kernel="short_conv_sweep", channels=C, parts=3, rows=rows, bc=bc, us=us,
                                    tb_s=2 * T * C * x.element_size() / us * 1e-6))
    finally:
        K.CONV_ROWS, K.CONV_BC = saved
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time other conv tiles")
    args = ap.parse_args()
    records = []
    print(f"{'shape':34} {'parts':>5} {'us':>8} {'TB/s':>6} {'replaced us':>11} {'x':>5} {'qkv copies us':>13}"
          f" {'rel err':>8}")
    for C, row, segments, why in SHAPES:
        for rec in run_shape(C, row, segments, why, args.reps):
            records.append(rec)
            old = f"{rec['replaced_us']:11.1f} {rec['speedup_vs_replaced']:5.2f}" if "replaced_us" in rec else \
                f"{'':11} {'':5}"
            copies = f"{rec['qkv_copies_us']:13.1f}" if "qkv_copies_us" in rec else f"{'':13}"
            print(f"{why:34} {rec['parts']:5} {rec['us']:8.1f} {rec['tb_s']:6.2f} {old} {copies}"
                  f" {rec['max_rel_err_vs_ref']:8.1e}")
    if args.sweep:
        print(f"\n{'rows':>5} {'bc':>5} {'us':>8} {'TB/s':>6}   (planes, C=12288, one segment)")
        for rec in sweep(args.reps):
            records.append(rec)
            print(f"{rec['rows']:5} {rec['bc']:5} {rec['us']:8.1f} {rec['tb_s']:6.2f}")
    write_results(records, args.json)


if __name__ == "__main__":
    main()
