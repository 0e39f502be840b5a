"""Compile the W4A16 decode kernels for sm_90 (no GPU needed) and count the SASS instructions of their inner K loop
per weight: the check that the tensor-core decode kernel (w4a16_tc.py) spends ~2 instructions per weight whatever
the rows, and the FMA kernel (w4a16_gemv.py) ~4-6.

    PYTHONPATH=$PWD python3 benchmarks/w4a16_sass.py [--dump DIR]

Needs a Triton whose NVIDIA backend ships ptxas / nvdisasm (a CUDA install of Triton; no driver). The loop is the
basic block that ends in the backward branch with the most instructions; opcodes are grouped by their mnemonic's
stem (LOP3, IMAD, PRMT, HMUL2, HMMA / HGMMA, LDG, LDGSTS, LDS, STS, ...). Counts are per K step of one program and
per weight (BN x BK weights per step, x2 for the GLU kernels' gate and up tiles)."""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kestrel.kernels.quant.w4a16_gemv import _w4a16_gemv_glu_kernel, _w4a16_gemv_kernel
from kestrel.kernels.quant.w4a16_tc import _w4a16_tc_glu_kernel, _w4a16_tc_kernel

PTRS = {"x_ptr": "*bf16", "rows_ptr": "*i32", "q_ptr": "*u8", "g_ptr": "*fp32", "y_ptr": "*bf16", "offs_ptr": "*i32"}


SIZES = ("M", "E", "N", "I", "K_SPLIT", "KW_SPLIT", "K", "KW")


def compile_sm90(kernel, const: dict, nvfp4: bool, warps: int, stages: int, words: bool = False,
                 sizes: dict | None = None):
    """triton.compile for sm_90 with every pointer 16-byte aligned and every int argument a runtime i32, marked
    16-divisible as a launch specializes it: the strides (contiguous stacks at these widths) always, the sizes
    (`sizes`: the launch's M, E, N, K, ... values) where theirs is a multiple of 16. Leaving K / KW unmarked lost the
    16-byte weight loads and added ~0.6 instructions per weight to the FMA kernel's count (its SASS as launched on
    the H200 came within 2% of the marked count)."""
    sig, attrs = {}, {}
    for i, p in enumerate(inspect.signature(kernel.fn).parameters):
        if p in const:
            sig[p] = "constexpr"
        elif p == "s_ptr":
            sig[p] = "*fp8e4nv" if nvfp4 else "*u8"
        elif p in PTRS:
            sig[p] = ("*i32" if p in ("x_ptr", "q_ptr") else PTRS[p]) if words else PTRS[p]
        elif p in ("beta", "lin_beta"):
            sig[p] = "fp32"
            continue
        else:
            sig[p] = "i32"
        if sig[p] != "constexpr" and (p not in SIZES or (sizes or {}).get(p, 1) % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def _bin(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass(k) -> str:
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.cubin")
        with open(f, "wb") as fh:
            fh.write(k.asm["cubin"])
        return subprocess.run([_bin("nvdisasm"), "-c", f], capture_output=True, text=True, check=True).stdout


def regs_spills(k) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx")
        with open(f, "w") as fh:
            fh.write(k.asm["ptx"])
        txt = subprocess.run([_bin("ptxas"), "-v", "-arch=sm_90a", f, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", txt)
    spill = re.search(r"(\d+) bytes spill stores", txt)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else -1


_INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LABEL = re.compile(r"^\.(L_x_\d+):")


def inner_loop(text: str) -> list[str]:
    """Mnemonics of the largest basic block range [label .. backward branch to it]."""
    lines = text.splitlines()
    labels, insns = {}, []
    for ln in lines:
        m = _LABEL.match(ln.strip())
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = _INSN.match(ln)
        if m:
            insns.append((m.group(3), m.group(4)))
    best: list[str] = []
    for i, (op, args) in enumerate(insns):
        if op.startswith("BRA"):
            t = re.search(r"`?\(?\.?(L_x_\d+)\)?", args)
            if t and t.group(1) in labels and labels[t.group(1)] <= i:
                body = [o for o, _ in insns[labels[t.group(1)]:i + 1]]
                if len(body) > len(best):
                    best = body
    return best


GROUPS = ("LOP3", "PRMT", "SHF", "IMAD", "IADD3", "LEA", "HMUL2", "HFMA2", "FFMA", "FMUL", "FADD", "HMMA", "HGMMA",
          "LDG", "LDGSTS", "LDS", "LDSM", "STS", "I2F", "F2F", "MOV", "BAR", "WARPGROUP")


def histogram(ops: list[str]) -> collections.Counter:
    c = collections.Counter()
    for op in ops:
        stem = op.split(".")[0]
        c[stem if stem in GROUPS else "other"] += 1
    return c


def cases():
    """(label, kernel, constexprs, nvfp4, warps, stages, weights per K step, FMA-kernel words, the launch's sizes)
    at the configs the host picks for K3 / Kimi Linear 48B decode (w4a16_config / w4a16_glu_config), both decode
    paths."""
    from kestrel.kernels.quant.w4a16 import w4a16_config
    from kestrel.kernels.quant.w4a16_glu import w4a16_glu_config
    out = []
    for model, E, k, n13, hidden in (("K3", 896, 16, 6144, 3584), ("KL48", 256, 8, 2048, 2304)):
        for fmt in ("mxfp4", "nvfp4"):
            nv = fmt == "nvfp4"
            base = dict(NVFP4=nv, DIVISOR=True, E_PAD=triton.next_power_of_2(E), SEL=0)
            for T in (1, 8, 64):
                S = T * k
                for gemm, N, K in (("w13", n13, hidden), ("w2", hidden, n13 // 2)):
                    for path in ("tc", "gemv"):
                        BM, BN, BK, w, st = cfg = w4a16_config(S, E, N, K, 32, path=path)
                        const = dict(base, GROUPED=True, GATHER=gemm == "w13", BN=BN, BK=BK)
                        if path == "tc":
                            kern, const = _w4a16_tc_kernel, dict(const, BM=BM, ASM=True)
                        else:
                            kern, const = _w4a16_gemv_kernel, dict(const, ROWS=BM)
                        sizes = dict(M=S, E=E, N=N, K=K, K_SPLIT=K, KW=K // 8, KW_SPLIT=K // 8)
                        out.append((f"{model} {fmt} T={T} {gemm} {path} {cfg}", kern, const, nv, w, st, BN * BK,
                                    path == "gemv", sizes))
                for path in ("tc", "gemv"):
                    BM, BN, BK, w, st = cfg = w4a16_glu_config(S, E, n13 // 2, hidden, path=path)
                    const = dict(base, ACT=1, BN=BN, BK=BK, RNE_BF16=False)
                    if path == "tc":
                        kern, const = _w4a16_tc_glu_kernel, dict(const, BM=BM, ASM=True)
                    else:
                        kern, const = _w4a16_gemv_glu_kernel, dict(const, ROWS=BM)
                    sizes = dict(E=E, I=n13 // 2, K=hidden, KW=hidden // 8)
                    out.append((f"{model} {fmt} T={T} w13+glu {path} {cfg}", kern, const, nv, w, st, 2 * BN * BK,
                                path == "gemv", sizes))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", help="write each kernel's SASS here")
    ap.add_argument("--only", default="", help="cases whose label contains this")
    args = ap.parse_args(argv)
    cols = ("LOP3", "PRMT", "SHF", "IMAD", "HMUL2", "FFMA", "HMMA", "HGMMA", "LDG", "LDGSTS", "LDS", "LDSM", "STS")
    print(f"{'case':<56} {'regs':>4} {'spill':>5} {'insn/step':>9} {'/weight':>7} " + " ".join(f"{c:>6}" for c in cols))
    seen = {}
    for label, kern, const, nv, warps, stages, weights, words, sizes in cases():
        if args.only not in label:
            continue
        key = (kern.fn.__name__, tuple(sorted(const.items())), nv, warps, stages,
               tuple(sorted((p, v % 16 == 0) for p, v in sizes.items())))
        if key not in seen:
            try:
                k = compile_sm90(kern, const, nv, warps, stages, words, sizes)
            except Exception as exc:          # report and go on: the table names the config that failed
                print(f"{label:<56} FAIL {type(exc).__name__}: {str(exc)[-300:]}")
                continue
            text = sass(k)
            seen[key] = (regs_spills(k), inner_loop(text), text)
        (regs, spill), body, text = seen[key]
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, re.sub(r"[^A-Za-z0-9]+", "_", label) + ".sass"), "w") as fh:
                fh.write(text)
        h = histogram(body)
        per = len(body) * 32 * warps / weights        # thread instructions per weight
        print(f"{label:<56} {regs:>4} {spill:>5} {len(body):>9} {per:>7.2f} "
              + " ".join(f"{h[c] * 32 * warps / weights:>6.3f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
