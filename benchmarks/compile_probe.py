"""Does Triton compile in parallel threads on the GPU machine? Start-up compiles every Triton variant the engine
launches (about 70 s of a cold 27-layer start on the H200), one after another. This compiles the same set of
distinct variants (the router GEMV's kernel over a grid of tile constexprs and warps) twice, each time into an
empty cache: one after another, then submitted to a thread pool through Triton's AsyncCompileMode (what
`kestrel.runtime.precompile.compile_only` uses).
    python3 benchmarks/compile_probe.py --variants 24 --threads 16
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", type=int, default=24,
                    help="at most 24: each half takes its own 24 of the 48 variants")
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tc-")
    import triton
    from triton.runtime._async_compile import AsyncCompileMode

    from kestrel.kernels.moe import router as R
    dev = torch.device("cuda")

    H = 2304
    x = torch.empty(1, H, device=dev, dtype=torch.bfloat16)
    w = torch.empty(64, H, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, 64, device=dev, dtype=torch.float32)
    grid = [(bt, be, bk, warps) for bt in (1, 2) for be in (1, 2, 4) for bk in (64, 128, 256, 512)
            for warps in (4, 8)]                                   # 48 distinct variants

    def warm(i: int, base: int):
        bt, be, bk, warps = grid[(base + i) % len(grid)]
        R._router_logits_kernel.warmup(x, w, out, 1, 64, H, x.stride(0), w.stride(0), out.stride(0), BT=bt, BE=be,
                                       BK=bk, EVEN_K=H % bk == 0, num_warps=warps, grid=(1,))

    knobs = getattr(triton, "knobs", None)
    n = args.variants
    t0 = time.perf_counter()
    for i in range(n):
        warm(i, 0)
    seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as ex, AsyncCompileMode(ex):
        for i in range(n):
            warm(i, n)
    par = time.perf_counter() - t0
    print(f"{n} variants: one after another {seq:.2f} s, {args.threads} threads {par:.2f} s ({seq / par:.2f}x); "
          f"cpus {os.cpu_count()}, triton {triton.__version__}, knobs {knobs is not None}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
