"""Where the W4A16 decode GEMMs lose bandwidth: the bytes-only ceiling of their tile patterns, on the GPU.

The tensor-core decode kernel (w4a16_tc.py) reaches 40-47% of copy bandwidth at K3's batch 64 and the FMA one
(w4a16_gemv.py) 55-63% at one row per expert, against the issue's 70%. This probe separates the load pattern from
the math: "stream" kernels read exactly the packed bytes of the touched experts that the GEMM reads, in the same
grid (one program per expert tile x BN weight rows) and do nothing with them but an XOR (so the loads stay), in
the checkpoint's [E, N, K/2] layout: each K step a [BN, BK/2] tile of BN rows, each BK/2 bytes, one row stride
apart (what both kernels read). Each variant prefetches PRE steps ahead in registers (Triton does not pipeline loads that feed no dot). Printed as
TB/s over the touched experts' packed bytes and % of a device copy in the same run, beside the real kernels'.

PYTHONPATH=$PWD python3 benchmarks/w4a16_probe.py [--cases T=1,T=8,T=64] [--out FILE]
PYTHONPATH=$PWD python3 benchmarks/w4a16_probe.py --once T=64   # one launch of the host's kernel (for ncu)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from quant_gemm_bench import _bench, _copy_tbs

from kestrel.catalog.quant.w4a16_grouped_gemm import W4A16GroupedGemm
from kestrel.kernels.moe._common import expert_tile, pow2
from kestrel.kernels.quant.w4a16 import w4a16_config, w4a16_gemm

DEV = torch.device("cuda")
GEMV_CONFIGS: list = []        # --gemv-configs
K3 = dict(E=896, k=16, N=6144, K=3584, gather=True, fmt="mxfp4")       # K3's w13 (the larger GEMM)


@triton.jit
def _stream_kernel(q_ptr, offs_ptr, out_ptr, E, KW, s_qe, s_qn, E_PAD: tl.constexpr, BN: tl.constexpr,
                   BKW: tl.constexpr, PRE: tl.constexpr):
    e, row_hi, row0 = expert_tile(offs_ptr, E, tl.program_id(0), E_PAD, 16)
    if e >= E:
        return
    pid_n = tl.program_id(1)
    base = q_ptr + e.to(tl.int64) * s_qe
    offs = ((pid_n * BN + tl.arange(0, BN)).to(tl.int64) * s_qn)[:, None] + tl.arange(0, BKW)[None, :]
    acc = tl.zeros([BN, BKW], dtype=tl.int32)
    steps = KW // BKW
    w0 = tl.load(base + offs)
    if PRE > 1:
        w1 = tl.load(base + offs + BKW)
    for i in range(steps):
        nxt = tl.minimum(i + PRE, steps - 1)
        wn = tl.load(base + offs + nxt * BKW)
        acc ^= w0
        if PRE > 1:
            w0 = w1
            w1 = wn
        else:
            w0 = wn
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + pid_n, tl.sum(tl.sum(acc, axis=1), axis=0))


def _inputs(T: int):
    gen = torch.Generator().manual_seed(T)
    d = W4A16GroupedGemm.make_inputs(dict(K3, T=T), DEV, gen)
    offs = d["expert_offsets"].cpu()
    touched = int((offs[1:] > offs[:-1]).sum())
    return d, touched


def run_case(T: int, copy: float, kernels_only: bool = False) -> list[dict]:
    d, touched = _inputs(T)
    E, N, Kh = d["packed"].shape
    q32 = d["packed"].view(torch.int32)
    KW = Kh // 4
    bytes_q = touched * N * Kh
    bytes_all = bytes_q + touched * d["scale"][0].numel()
    S = d["sorted_token_ids"].numel()
    out = torch.empty((S, N), dtype=torch.bfloat16, device=DEV)
    rows = []

    def record(name, ms, nbytes):
        tbs = nbytes / (ms * 1e-3) / 1e12
        rows.append(dict(T=T, variant=name, ms=ms, tb_per_s=tbs, frac_of_copy=tbs / copy, touched=touched))
        print(f"T={T:3d} {name:44s} {ms * 1e3:8.1f} us {tbs:5.2f} TB/s {100 * tbs / copy:5.1f}% of copy", flush=True)

    configs = [("host", None)] + [(path, w4a16_config(S, E, N, 2 * Kh, 32, path=path)) for path in ("tc", "gemv")]
    configs += [("gemv", c) for c in GEMV_CONFIGS]
    for path, cfg in configs:
        fn = lambda cfg=cfg: w4a16_gemm(d["x"], d["packed"], d["scale"], None, True, d["expert_offsets"],
                                        d["sorted_token_ids"], out=out, config=cfg)
        record(f"kernel {path} {cfg or ''}", _bench(fn), bytes_all)
    if kernels_only:
        return rows
    m_tiles = triton.cdiv(S, 16) + min(E, S)
    sink = torch.empty(m_tiles * N, dtype=torch.int32, device=DEV)
    for BN, BKW, warps, pre in ((128, 16, 2, 1), (128, 16, 2, 2), (128, 16, 4, 2), (128, 32, 4, 1),
                                (128, 32, 4, 2), (64, 32, 2, 2), (256, 16, 4, 2)):
        grid = (m_tiles, N // BN)
        fn = lambda: _stream_kernel[grid](q32, d["expert_offsets"], sink, E, KW, q32.stride(0), q32.stride(1),
                                          E_PAD=pow2(E), BN=BN, BKW=BKW, PRE=pre, num_warps=warps)
        record(f"stream rows  BN {BN} BK {BKW * 8} warps {warps} pre {pre}", _bench(fn), bytes_q)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="T=1,T=8,T=64")
    ap.add_argument("--once", help="one launch of the host's kernel at this case, for ncu")
    ap.add_argument("--path", default=None, help="with --once: tc | gemv")
    ap.add_argument("--kernels-only", action="store_true", help="time the host's kernels, not the stream ceilings")
    ap.add_argument("--gemv-configs", default="", help="also time the FMA kernel at these 'BM,BN,BK,warps,stages'")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    GEMV_CONFIGS[:] = [tuple(int(v) for v in c.split(",")) for c in args.gemv_configs.split()]
    if args.once:
        T = int(args.once.split("=")[1])
        d, _ = _inputs(T)
        E, N, Kh = d["packed"].shape
        S = d["sorted_token_ids"].numel()
        cfg = w4a16_config(S, E, N, 2 * Kh, 32, path=args.path)
        for _ in range(3):
            w4a16_gemm(d["x"], d["packed"], d["scale"], None, True, d["expert_offsets"], d["sorted_token_ids"],
                       config=cfg)
        torch.cuda.synchronize()
        print("ran", cfg)
        return 0
    copy = _copy_tbs()
    print(f"copy {copy:.2f} TB/s")
    rows = []
    for c in args.cases.split(","):
        rows += run_case(int(c.split("=")[1]), copy, args.kernels_only)
    if args.out:
        with open(args.out, "w") as f:
            command = "python3 benchmarks/w4a16_probe.py " + " ".join(argv or sys.argv[1:])
            json.dump(dict(machine=torch.cuda.get_device_name(), command=command, copy_tb_per_s=copy, records=rows),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
