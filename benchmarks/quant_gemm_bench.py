"""Quantized GEMMs on the GPU: W4A16 (MXFP4 / NVFP4) grouped (also with the GLU fused) and dense, W8A8 FP8 dense,
against a baseline in the same run.

Run on the H200 from the repo root: PYTHONPATH=$PWD python3 benchmarks/quant_gemm_bench.py --out $OUT/quant_gemm.json
(JSON {machine, command, records}, benchmarks/_results.py)
(`--only K3` filters cases by name, `--quick` keeps the decode batches 1, 8, 64 and one prefill shape per model,
`--sweep` also tries a grid of tile configs per case, checks each against the default's output and reports the
fastest: use it with `--only` on a few cases, each config compiles once). Each grouped record names the config the
host picked (`config`: BM, BN, BK, warps, stages; BM 16 at decode is the tensor-core decode kernel, w4a16_tc.py;
BM 1, 2 or 4 the FMA decode kernel, w4a16_gemv.py, with that many rows per program; 64 and up the prefill tiles).
At decode shapes the record's `paths` times both decode kernels at their host configs (`tc`, and `gemv` while an
expert holds at most 4 rows) at the same shape, printed under the case as % of copy; with --sweep each path's
grid is searched and its best kept there.

Each case times the entry's raw_call with triton.testing.do_bench (median; L2 flushed between runs) and reports
- TB/s over the bytes of the weights it must read: packed values + scales (+ NVFP4 tensor scales) of the experts
  that received tokens (grouped) or of the whole matrix (dense); activations and outputs are not counted;
- that as a fraction of 4.2 TB/s (the H200's nominal HBM bandwidth) and of a device-to-device copy measured in the
  same run (read + write bytes / time), the issue's decode criterion being >= 70%;
- TFLOP/s (2 x rows x N x K) and the speedup over the baseline at the same shape ("base" columns): the bf16 path,
  `MoeGroupedGemm` (grouped) or torch.matmul (dense), with its own TB/s over its bf16 weights; for the `w13+glu`
  rows (`W4A16GroupedGemmGlu`, N = 2I the w13 rows it reads) the pair of launches it replaces in the quantized
  targets, W4A16GroupedGemm over w13 then SiluGlu / SituGlu, over the same FP4 bytes.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.testing
from _results import write_results

from kestrel.catalog.moe.glu import SiluGlu, SituGlu
from kestrel.catalog.moe.grouped_gemm import MoeGroupedGemm
from kestrel.catalog.quant.fp8_linear import Fp8Linear
from kestrel.catalog.quant.fp8_quant_rows import Fp8QuantRows
from kestrel.catalog.quant.w4a16_grouped_gemm import W4A16GroupedGemm
from kestrel.catalog.quant.w4a16_grouped_gemm_glu import W4A16GroupedGemmGlu
from kestrel.catalog.quant.w4a16_linear import W4A16Linear
from kestrel.kernels.quant.fp8 import fp8_gemm
from kestrel.kernels.quant.w4a16 import TC_DECODE_BM, block_k, w4a16_config, w4a16_gemm
from kestrel.kernels.quant.w4a16_gemv import ROW_CHOICES
from kestrel.kernels.quant.w4a16_glu import w4a16_glu_config, w4a16_glu_gemm

HBM_TBS = 4.2
DEV = torch.device("cuda")
SWEEP = False
TC_GRID: list = []   # --tc-grid

# (model, experts, top-k, w13 N, hidden / latent, GLU)
MOE = {"K3": (896, 16, 6144, 3584, "situ"), "Kimi Linear 48B": (256, 8, 2048, 2304, "silu")}
DECODE = (1, 8, 16, 32, 64)
PREFILL = (8192,)


def _cases(quick: bool):
    decode = (1, 8, 64) if quick else DECODE
    for model, (E, k, n13, hidden, act) in MOE.items():
        for fmt in ("mxfp4", "nvfp4"):
            for T in decode + PREFILL:
                phase = "prefill" if T >= 1024 else "decode"
                yield (f"{model} {fmt} {phase} T={T} w13", "grouped",
                       dict(T=T, E=E, k=k, N=n13, K=hidden, gather=True, fmt=fmt))
                yield (f"{model} {fmt} {phase} T={T} w13+glu", "glu",
                       dict(T=T, E=E, k=k, I=n13 // 2, K=hidden, fmt=fmt, act=act))
                yield (f"{model} {fmt} {phase} T={T} w2", "grouped",
                       dict(T=T, E=E, k=k, N=hidden, K=n13 // 2, gather=False, fmt=fmt))
    for fmt in ("mxfp4", "nvfp4"):
        for M in (1, 64, 8192):
            yield f"K3 dense {fmt} M={M} 7168 -> 3584", "dense", dict(M=M, K=7168, N=3584, fmt=fmt)
    for gran in ("block", "channel", "mx"):
        shapes = [(7168, 3584), (12288, 7168), (7168, 12288)] if gran == "block" else [(7168, 3584)]
        for K, N in shapes:
            for M in (1, 64, 8192):
                yield f"K3 trunk fp8 {gran} M={M} {K} -> {N}", "fp8", dict(M=M, K=K, N=N, granularity=gran)


def _bench(fn) -> float:
    """Median milliseconds."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _copy_tbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * (1 << 30) / (ms * 1e-3) / 1e12


def _sweep_configs(decode: bool, K: int, group: int, fp8: bool):
    """(BM, BN, BK, num_warps, num_stages) candidates; BK kept to divisors of K holding whole scale blocks. W4A16
    decode (BM 16) is the tensor-core decode kernel (w4a16_tc.py)."""
    bms = (64,) if fp8 and decode else ((16,) if decode else (64, 128))
    bns = (32, 64, 128) if fp8 and decode else ((64, 128, 256) if decode else (128, 256))
    if fp8:         # a K step may not straddle two weight scales
        bks = [bk for bk in (32, 64, 128) if bk <= group and K % bk == 0]
    else:
        bks = sorted({block_k(K, group, cap) for cap in ((128, 256) if decode else (64, 128))})
    for bm in bms:
        for bn in bns:
            for bk in bks:
                for warps in ((2, 4, 8) if decode and not fp8 else (4, 8)):
                    for stages in ((3, 5) if decode else (3, 4)):
                        yield bm, bn, bk, warps, stages


def _decode_sweep(default, K: int):
    """The FMA decode kernel's candidates around the host's pick `default` (BM = rows per program): the same
    rows and one fewer / more (a tile of fewer rows re-reads an expert's weights, mostly from L2; more rows
    waste FMAs on absent ones), N tiles of 32..128 rows, K steps of 128 / 256, 4 or 8 warps (at most 36 configs;
    num_stages stays the default's: these loads feed no dot, so Triton does not pipeline them and sm_90 SASS is
    the same for any stages)."""
    rows = ROW_CHOICES.index(default[0])
    for r in ROW_CHOICES[max(0, rows - 1):rows + 2]:
        for bn in (32, 64, 128):
            for bk in sorted({block_k(K, 32, cap) for cap in (128, 256)}):
                for warps in (4, 8):
                    if bn * bk // 8 >= 128 * warps:     # at least 4 packed words per thread
                        yield r, bn, bk, warps, default[4]


def _configs(default, decode: bool, K: int, group: int):
    if TC_GRID and default[0] == TC_DECODE_BM:
        return [c for c in TC_GRID if K % c[2] == 0]
    if default[0] in ROW_CHOICES:
        return _decode_sweep(default, K)
    return _sweep_configs(decode, K, group, False)


def _paths(make_config, decode: bool):
    """{path: the host's config} for the decode paths to time at this shape: the tensor-core decode kernel and,
    while the rows per expert are few enough for it, the FMA kernel (w4a16_gemv.py); the default alone otherwise."""
    paths = {"default": make_config(None)}
    if decode:
        for path in ("tc", "gemv"):
            cfg = make_config(path)
            if (cfg[0] == TC_DECODE_BM) if path == "tc" else (cfg[0] in ROW_CHOICES):
                paths[path] = cfg
    return paths


def _best(run, reference: torch.Tensor, configs) -> dict | None:
    """The fastest config whose output matches the default config's (rtol 1e-2: same math, other tiles)."""
    best = None
    for cfg in configs:
        try:
            y = run(cfg)
            if not torch.allclose(y.float(), reference.float(), rtol=1e-2, atol=1e-2):
                print(f"    config {cfg}: output differs from the default, skipped")
                continue
            ms = _bench(lambda: run(cfg))
            if TC_GRID:
                print(f"    config {cfg}: {ms:.4f} ms", flush=True)
        except Exception as exc:           # a config that does not compile (shared memory, registers)
            print(f"    config {cfg}: {type(exc).__name__}")
            continue
        if best is None or ms < best["ms"]:
            best = dict(ms=ms, config=list(cfg))
    return best


def _by_path(run, reference: torch.Tensor, paths: dict, K: int, group: int,
             default_ms: float) -> tuple[dict, dict | None]:
    """Each decode path at its host config, timed at the same shape ({path: {config, ms}}; the default's own
    timing where the configs agree), and under --sweep the fastest config over every path's grid (each path's best
    kept in its record too)."""
    by_path = {}
    for path, cfg in paths.items():
        if path != "default":
            ms = default_ms if cfg == paths["default"] else _bench(lambda: run(cfg))
            by_path[path] = dict(config=list(cfg), ms=ms)
    best = None
    if SWEEP:
        for path, cfg in paths.items():
            if (path == "default" and len(paths) > 1) or (TC_GRID and cfg[0] != TC_DECODE_BM):
                continue
            b = _best(run, reference, _configs(cfg, cfg[0] in ROW_CHOICES + (TC_DECODE_BM,), K, group))
            if path in by_path:
                by_path[path]["best"] = b
            if b and (best is None or b["ms"] < best["ms"]):
                best = b
    return by_path, best


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _grouped(spec, gen):
    d = W4A16GroupedGemm.make_inputs(spec, DEV, gen)
    offs = d["expert_offsets"].cpu()
    touched = int((offs[1:] > offs[:-1]).sum())
    E = d["packed"].shape[0]
    wbytes = _nbytes(d["packed"], d["scale"], d.get("second")) * touched // E
    S = d["sorted_token_ids"].numel() if d["sorted_token_ids"] is not None else d["x"].shape[0]
    N, K = d["packed"].shape[1], 2 * d["packed"].shape[2]
    out = torch.empty((S, N), dtype=torch.bfloat16, device=DEV)
    ms = _bench(lambda: W4A16GroupedGemm.raw_call(**dict(d, out=out)))
    config = w4a16_config(S, E, N, K, 32)
    ref = out.clone()

    def run(cfg):
        return w4a16_gemm(d["x"], d["packed"], d["scale"], d.get("second"), d.get("divisor", True),
                          d["expert_offsets"], d["sorted_token_ids"], out=out, config=cfg)
    paths = _paths(lambda path: w4a16_config(S, E, N, K, 32, path=path), S / max(1, min(E, S)) <= 16)
    by_path, best = _by_path(run, ref, paths, K, 16 if "second" in d else 32, ms)
    del d["packed"], d["scale"]
    w = torch.empty((E, N, K), dtype=torch.bfloat16, device=DEV).normal_(std=K ** -0.5)
    base = _bench(lambda: MoeGroupedGemm.raw_call(d["x"], w, d["expert_offsets"], d["sorted_token_ids"], out=out))
    base_bytes = N * K * 2 * touched
    del w
    return dict(rows=S, N=N, K=K, experts_touched=touched, weight_bytes=wbytes, ms=ms, base_ms=base,
                base_bytes=base_bytes, best=best, config=list(config), paths=by_path)


def _grouped_glu(spec, gen):
    d = W4A16GroupedGemmGlu.make_inputs(spec, DEV, gen)
    offs = d["expert_offsets"].cpu()
    touched = int((offs[1:] > offs[:-1]).sum())
    E, N, Kh = d["packed"].shape
    wbytes = _nbytes(d["packed"], d["scale"], d.get("second")) * touched // E
    S, K = d["sorted_token_ids"].numel(), 2 * Kh
    out = torch.empty((S, N // 2), dtype=torch.bfloat16, device=DEV)
    ms = _bench(lambda: W4A16GroupedGemmGlu.raw_call(**dict(d, out=out)))
    config = w4a16_glu_config(S, E, N // 2, K)
    ref = out.clone()

    def run(cfg):
        return w4a16_glu_gemm(d["x"], d["packed"], d["scale"], d.get("second"), d.get("divisor", True),
                              d["expert_offsets"], d["sorted_token_ids"], d["act"], d["beta"], d["linear_beta"],
                              out=out, config=cfg)
    paths = _paths(lambda path: w4a16_glu_config(S, E, N // 2, K, path=path), S / max(1, min(E, S)) <= 16)
    by_path, best = _by_path(run, ref, paths, K, 16 if "second" in d else 32, ms)
    w13 = {k: d[k] for k in ("packed", "scale", "second", "divisor") if k in d}
    gu = torch.empty((S, N), dtype=torch.bfloat16, device=DEV)

    def unfused():
        W4A16GroupedGemm.raw_call(d["x"], expert_offsets=d["expert_offsets"], sorted_token_ids=d["sorted_token_ids"],
                                  out=gu, **w13)
        if d["act"] == "situ":
            SituGlu.raw_call(gu, d["beta"], d["linear_beta"], out=out)
        else:
            SiluGlu.raw_call(gu, out=out)
    base = _bench(unfused)
    return dict(rows=S, N=N, K=K, experts_touched=touched, weight_bytes=wbytes, ms=ms, base_ms=base,
                base_bytes=wbytes, base="W4A16GroupedGemm + SiluGlu / SituGlu", best=best, config=list(config),
                paths=by_path)


def _dense(spec, gen):
    d = W4A16Linear.make_inputs(spec, DEV, gen)
    M, N, K = d["x"].shape[0], d["packed"].shape[0], d["x"].shape[1]
    out = torch.empty((M, N), dtype=torch.bfloat16, device=DEV)
    ms = _bench(lambda: W4A16Linear.raw_call(**dict(d, out=out)))
    best = None
    if SWEEP:
        best = _best(lambda cfg: w4a16_gemm(d["x"], d["packed"], d["scale"], d.get("second"),
                                            d.get("divisor", True), out=out, config=cfg),
                     out.clone(), _sweep_configs(M <= 16, K, 16 if "second" in d else 32, False))
    w = torch.empty((N, K), dtype=torch.bfloat16, device=DEV).normal_(std=K ** -0.5)
    base = _bench(lambda: torch.matmul(d["x"], w.t(), out=out))
    return dict(rows=M, N=N, K=K, weight_bytes=_nbytes(d["packed"], d["scale"], d.get("second")), ms=ms,
                base_ms=base, base_bytes=N * K * 2, best=best)


def _fp8(spec, gen):
    d = Fp8Linear.make_inputs(spec, DEV, gen)
    M, K = d["xq"].shape
    N = d["weight"].shape[0]
    out = torch.empty((M, N), dtype=torch.bfloat16, device=DEV)
    ms = _bench(lambda: Fp8Linear.raw_call(**dict(d, out=out)))
    best = None
    if SWEEP:
        group = 32 if d["weight_scale"].dtype == torch.uint8 else 128
        best = _best(lambda cfg: fp8_gemm(d["xq"], d["x_scale"], d["weight"], d["weight_scale"], out=out,
                                          config=cfg), out.clone(), _sweep_configs(M <= 64, K, group, True))
    x = torch.randn((M, K), dtype=torch.bfloat16, device=DEV)
    q, s = torch.empty_like(d["xq"]), torch.empty_like(d["x_scale"])
    quant_ms = _bench(lambda: Fp8QuantRows.raw_call(x, q, s))
    w = torch.empty((N, K), dtype=torch.bfloat16, device=DEV).normal_(std=K ** -0.5)
    base = _bench(lambda: torch.matmul(x, w.t(), out=out))
    return dict(rows=M, N=N, K=K, weight_bytes=_nbytes(d["weight"], d["weight_scale"]), ms=ms,
                quant_ms=quant_ms, base_ms=base, base_bytes=N * K * 2, best=best)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the records as JSON here")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--quick", action="store_true", help="one decode and one prefill shape per model")
    ap.add_argument("--sweep", action="store_true", help="also try a grid of tile configs per case")
    ap.add_argument("--tc-grid", default="", help="with --sweep: the tensor-core decode kernel's configs to try, "
                    "'BM,BN,BK,warps,stages' separated by spaces (each printed with its time), instead of its grid")
    args = ap.parse_args(argv)
    global SWEEP, TC_GRID
    SWEEP = args.sweep or bool(args.tc_grid)
    TC_GRID = [tuple(int(v) for v in c.split(",")) for c in args.tc_grid.split()]
    if not torch.cuda.is_available():
        print("quant_gemm_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    copy = _copy_tbs()
    print(f"{torch.cuda.get_device_name()}  device copy {copy:.2f} TB/s (read + write)")
    header = (f"{'case':<44} {'ms':>8} {'TB/s':>6} {'%4.2':>5} {'%copy':>5} {'TFLOP/s':>7} {'base ms':>8} "
              f"{'base TB/s':>9} {'speedup':>7}")
    print(header)
    print("-" * len(header))
    records = []
    gen = torch.Generator().manual_seed(0)
    run = {"grouped": _grouped, "glu": _grouped_glu, "dense": _dense, "fp8": _fp8}
    for name, kind, spec in _cases(args.quick):
        if args.only not in name:
            continue
        r = run[kind](spec, gen)
        tbs = r["weight_bytes"] / (r["ms"] * 1e-3) / 1e12
        tflops = 2 * r["rows"] * r["N"] * r["K"] / (r["ms"] * 1e-3) / 1e12
        rec = dict(bench="quant_gemm", case=name, kind=kind, spec={k: str(v) for k, v in spec.items()}, **r,
                   tb_per_s=tbs, hbm_tb_per_s=HBM_TBS, frac_of_hbm=tbs / HBM_TBS, copy_tb_per_s=copy,
                   frac_of_copy=tbs / copy, tflop_per_s=tflops, torch=torch.__version__, triton=triton.__version__,
                   base_tb_per_s=r["base_bytes"] / (r["base_ms"] * 1e-3) / 1e12, speedup=r["base_ms"] / r["ms"])
        records.append(rec)
        print(f"{name:<44} {r['ms']:8.4f} {tbs:6.2f} {100 * tbs / HBM_TBS:5.0f} {100 * tbs / copy:5.0f} "
              f"{tflops:7.1f} {r['base_ms']:8.4f} {rec['base_tb_per_s']:9.2f} {rec['speedup']:7.2f}"
              + (f"  (+ act quant {r['quant_ms']:.4f} ms)" if "quant_ms" in r else "")
              + (f"  config {r['config']}" if "config" in r else ""), flush=True)
        for path, p in r.get("paths", {}).items():
            p["frac_of_copy"] = r["weight_bytes"] / (p["ms"] * 1e-3) / 1e12 / copy
            print(f"    {path:<5} config {p['config']}: {p['ms']:.4f} ms, {100 * p['frac_of_copy']:.0f}% of copy"
                  + (f"; best {p['best']['config']}: {p['best']['ms']:.4f} ms, "
                     f"{100 * r['weight_bytes'] / (p['best']['ms'] * 1e-3) / 1e12 / copy:.0f}% of copy"
                     if p.get("best") else ""), flush=True)
        if r["best"]:
            b = r["best"]
            print(f"    best config {b['config']}: {b['ms']:.4f} ms, "
                  f"{r['weight_bytes'] / (b['ms'] * 1e-3) / 1e12:.2f} TB/s", flush=True)
        torch.cuda.empty_cache()
    write_results(records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
