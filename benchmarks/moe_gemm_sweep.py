"""The prefill MoE GEMMs at Kimi Linear 48B's widths (one 8,192-token prompt: 65,536 expert rows over 256 experts,
w13 [256, 2048, 2304], w2 [256, 2304, 1024]) under several tile configs, against cuBLAS's dense GEMM of the same
FLOPs (the rows of all experts as one matrix against one expert's weight: the ceiling a grouped GEMM aims at).
Also the two ways the experts can run: MoeExperts' path (w13 GEMM -> GLU -> w2 GEMM) against the GLU fused into the
w13 GEMM's epilogue. CUDA events, median of `--iters`.
    python3 benchmarks/moe_gemm_sweep.py --json $OUT/moe_gemm_sweep.json
With `--variants` it instead compares the grouped GEMM's kernels (grouped_gemm.py: `pointer`, the TMA-loaded
`tma`, the persistent `tma-persistent` / `-split` / `-noflat`) over VARIANT_CONFIGS (or `--config-list`), each row
checked against a float32 torch reference on a few experts, over every row (the output starts as NaN), and replayed
from a CUDA graph; one failing compile is reported in its row and the others still run:
    python3 benchmarks/moe_gemm_sweep.py --variants pointer,tma,tma-persistent --json $OUT/moe_gemm_tma.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kestrel.kernels.moe.grouped_gemm as gg          # noqa: E402
import kestrel.kernels.moe.grouped_gemm_glu as ggg     # noqa: E402
from kestrel.kernels.activation.glu import glu        # noqa: E402
from benchmarks._results import median_ms        # noqa: E402
from kestrel.kernels.moe.permute import moe_permute    # noqa: E402

# (BM, BN, BK, num_warps, num_stages); the first is what _config picks today for prefill-sized batches
CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
           (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
           (64, 128, 64, 4, 4)]
# the `--variants` sweep's configs: today's first
VARIANT_CONFIGS = [(128, 256, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5),
                   (256, 128, 64, 8, 3)]
# variant -> (grouped_gemm's tma=, PERSISTENT_FLATTEN, EPILOGUE_SPLIT)
VARIANTS = {"pointer": ("off", True, False), "tma": ("on", True, False), "tma-split": ("on", True, True),
            "tma-persistent": ("persistent", True, False), "tma-persistent-split": ("persistent", True, True),
            "tma-persistent-noflat": ("persistent", False, False)}


def timed(fn, iters: int) -> float:
    return median_ms(fn, iters, warmup=3)


def parse_configs(text: str) -> list[tuple[int, int, int, int, int]]:
    """'128x256x64:8:4,128x128x64:8:5' -> [(BM, BN, BK, warps, stages), ...]"""
    out = []
    for item in text.split(","):
        tile, warps, stages = item.split(":")
        out.append((*(int(v) for v in tile.split("x")), int(warps), int(stages)))
    return out


def check(y: torch.Tensor, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, ids: torch.Tensor | None) -> dict:
    """max |y - float32 torch| over a few experts' rows, and whether any row of y was left unwritten (NaN)."""
    E = w.shape[0]
    o = offs.tolist()
    err = big = 0.0
    for e in sorted({0, 1, E // 3, E // 2, (2 * E) // 3, E - 1}):
        lo, hi = o[e], o[e + 1]
        if hi == lo:
            continue
        rows = a[ids[lo:hi].long()] if ids is not None else a[lo:hi]
        ref = rows.float() @ w[e].float().t()
        err = max(err, (y[lo:hi].float() - ref).abs().max().item())
        big = max(big, ref.abs().max().item())
    nan = bool(y.isnan().any().item())
    # bf16 output: within one unit in the last place, 2^-7 of |y| (round-to-nearest gives half that)
    return {"max_abs_err": err, "max_abs_ref": round(big, 3), "unwritten": nan, "ok": not nan and err <= big * 2 ** -7}


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def isolated(args, rows) -> None:
    """Each variant in its own process: a kernel that faults (a sticky CUDA error) loses only its own rows."""
    import subprocess
    import tempfile
    for v in args.variants.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, os.path.abspath(__file__), "--variants", v, "--no-baselines", "--json", tmp.name,
                   "--tokens", str(args.tokens), "--iters", str(args.iters), "--configs", args.configs]
            if args.config_list:
                cmd += ["--config-list", args.config_list]
            try:
                proc = subprocess.run(cmd, timeout=args.variant_timeout)
                if proc.returncode == 0:
                    with open(tmp.name) as f:
                        rows.extend(json.load(f)["records"])
                    continue
                error = f"exit status {proc.returncode}"
            except subprocess.TimeoutExpired:
                error = f"timed out after {args.variant_timeout} s"
            print(f"{v}: {error}", flush=True)
            rows.append({"variant": v, "error": error})


def variant_sweep(args, rows, x, w13, w2, h, perm, flops13, flops2) -> None:
    S, E = h.shape[0], w13.shape[0]
    offs, ids = perm.expert_offsets, perm.sorted_token_ids
    gemms = [("w13", x, w13, ids, flops13), ("w2", h, w2, None, flops2)]
    configs = (parse_configs(args.config_list) if args.config_list else
               [gg._config(S, E, w13.shape[1], w13.shape[2])] if args.configs == "current" else VARIANT_CONFIGS)
    saved = gg._config, gg.PERSISTENT_FLATTEN, gg.EPILOGUE_SPLIT
    try:
        for variant in args.variants.split(","):
            mode, flatten, split = VARIANTS[variant]
            gg.PERSISTENT_FLATTEN, gg.EPILOGUE_SPLIT = flatten, split
            for cfg in configs:
                gg._config = (lambda *_, c=cfg: c)
                for name, a, w, rid, flops in gemms:
                    rec = {"variant": variant, "gemm": name, "config": cfg}
                    try:
                        out = torch.full((S, w.shape[1]), float("nan"), device=a.device, dtype=torch.bfloat16)
                        fn = (lambda a=a, w=w, rid=rid, out=out: gg.grouped_gemm(a, w, offs, sorted_token_ids=rid,
                                                                                out=out, tma=mode))
                        fn()
                        torch.cuda.synchronize()
                        rec.update(check(out, a, w, offs, rid))
                        ms = timed(fn, args.iters)
                        rec.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
                        # the launch inside a CUDA graph (host-side descriptors are kernel arguments): same output
                        ref = out.clone()
                        out.fill_(float("nan"))
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            fn()
                        out.fill_(float("nan"))
                        g.replay()
                        torch.cuda.synchronize()
                        rec["graph_ok"] = bool(torch.equal(out, ref))
                        print(f"{variant:22s} {name:4s} {str(cfg):22s} {ms:8.3f} ms {rec['tflops']:7.1f} TFLOP/s  "
                              f"err {rec['max_abs_err']:.2e} (|ref| {rec['max_abs_ref']}) ok={rec['ok']} "
                              f"graph={rec['graph_ok']}", flush=True)
                    except Exception as e:          # past shared memory or registers, or a Triton feature missing
                        rec["error"] = first_line(e)
                        print(f"{variant:22s} {name:4s} {str(cfg):22s} failed: {rec['error']}", flush=True)
                    rows.append(rec)
    finally:
        gg._config, gg.PERSISTENT_FLATTEN, gg.EPILOGUE_SPLIT = saved


def baselines(args, row, x, w13, w2, h, perm, S, H, I, flops13, flops2) -> None:
    """cuBLAS's dense GEMM of the same FLOPs, torch._grouped_mm, and how far the latter is from ours."""
    a13, b13 = torch.randn(S, H, device=x.device).to(torch.bfloat16), w13[0].t().contiguous()
    a2, b2 = torch.randn(S, I, device=x.device).to(torch.bfloat16), w2[0].t().contiguous()
    row("cublas dense (w13 shape)", timed(lambda: a13 @ b13, args.iters), flops13)
    row("cublas dense (w2 shape)", timed(lambda: a2 @ b2, args.iters), flops2)
    # torch's own grouped GEMM (CUTLASS on sm_90), the library candidate: it needs the gathered rows, so w13 is
    # timed with and without the gather copy that our kernel's sorted_token_ids load avoids
    offs = perm.expert_offsets[1:].to(torch.int32)
    xg = x[perm.sorted_token_ids.long()]
    row("torch._grouped_mm w13", timed(lambda: torch._grouped_mm(xg, w13.transpose(1, 2), offs=offs), args.iters),
        flops13)
    row("torch._grouped_mm w13+gather", timed(lambda: torch._grouped_mm(
        x[perm.sorted_token_ids.long()], w13.transpose(1, 2), offs=offs), args.iters), flops13)
    row("torch._grouped_mm w2", timed(lambda: torch._grouped_mm(h, w2.transpose(1, 2), offs=offs), args.iters),
        flops2)
    ref13 = gg.grouped_gemm(x, w13, perm.expert_offsets, sorted_token_ids=perm.sorted_token_ids).float()
    got13 = torch._grouped_mm(xg, w13.transpose(1, 2), offs=offs).float()
    print(f"torch._grouped_mm w13 vs ours: max |diff| {(got13 - ref13).abs().max().item():.3e} "
          f"(max |ref| {ref13.abs().max().item():.3e})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--configs", choices=["all", "current"], default="all",
                    help="current: only the config the host picks today (one compile per kernel)")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated, of {', '.join(VARIANTS)}: the kernel comparison instead of the tile sweep")
    ap.add_argument("--config-list", default=None, help="with --variants: e.g. 128x256x64:8:4,128x128x64:8:5")
    ap.add_argument("--isolate", action="store_true", help="with --variants: each variant in its own process")
    ap.add_argument("--variant-timeout", type=int, default=300, help="with --isolate: seconds a variant may take")
    ap.add_argument("--no-baselines", action="store_true", help="skip the cuBLAS / torch._grouped_mm rows")
    args = ap.parse_args()
    unknown = [v for v in (args.variants or "").split(",") if args.variants and v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}")
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    T, H, I, E, k = args.tokens, 2304, 1024, 256, 8
    x = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(torch.bfloat16)
    ids = torch.rand(T, E, device=dev, generator=gen).topk(k, dim=1).indices.to(torch.int32)
    perm = moe_permute(ids, E)
    S = T * k
    h = torch.randn(S, I, device=dev, generator=gen).to(torch.bfloat16)
    flops13, flops2 = 2.0 * S * 2 * I * H, 2.0 * S * H * I
    rows = []

    def row(name, ms, flops, cfg=None):
        rows.append({"gemm": name, "config": cfg, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)})
        print(f"{name:28s} {str(cfg):26s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)

    if not args.no_baselines:
        baselines(args, row, x, w13, w2, h, perm, S, H, I, flops13, flops2)
    if args.variants:
        if args.isolate:
            isolated(args, rows)
        else:
            variant_sweep(args, rows, x, w13, w2, h, perm, flops13, flops2)
        write_json(args, T, H, I, E, k, rows)
        return 0
    real = gg._config
    try:
        for cfg in CONFIGS if args.configs == "all" else [real(S, E, 2 * I, H)]:
            gg._config = ggg._config = (lambda *_, c=cfg: c)
            try:
                row("w13 grouped (gather)", timed(lambda: gg.grouped_gemm(
                    x, w13, perm.expert_offsets, sorted_token_ids=perm.sorted_token_ids), args.iters), flops13, cfg)
                row("w2 grouped", timed(lambda: gg.grouped_gemm(h, w2, perm.expert_offsets), args.iters), flops2, cfg)
                row("w13 grouped + GLU epilogue", timed(lambda: ggg.grouped_gemm_glu(
                    x, w13, perm.expert_offsets, perm.sorted_token_ids), args.iters), flops13, cfg)
            except Exception as e:          # a config past shared memory or registers: reported, not fatal
                print(f"{str(cfg):26s} failed: {str(e).splitlines()[0][:120]}", flush=True)
                rows.append({"config": cfg, "error": str(e).splitlines()[0][:200]})
    finally:
        gg._config = ggg._config = real
    # the half-height tail tiles (grouped_gemm.TAIL_MIN_BM) on and off, today's config
    on = gg.TAIL_MIN_BM
    for label, tail in (("tail tiles off", 10 ** 9), ("tail tiles on", on)):
        gg.TAIL_MIN_BM = tail
        row(f"w13 grouped, {label}", timed(lambda: gg.grouped_gemm(
            x, w13, perm.expert_offsets, sorted_token_ids=perm.sorted_token_ids), args.iters), flops13)
        row(f"w2 grouped, {label}", timed(lambda: gg.grouped_gemm(h, w2, perm.expert_offsets), args.iters), flops2)
    gg.TAIL_MIN_BM = on
    # the experts end to end with today's configs: MoeExperts' path against the GLU-fused first GEMM
    gu = torch.empty(S, 2 * I, device=dev, dtype=torch.bfloat16)
    row("path: w13 -> GLU -> w2", timed(lambda: gg.grouped_gemm(glu(gg.grouped_gemm(
        x, w13, perm.expert_offsets, sorted_token_ids=perm.sorted_token_ids, out=gu), "silu"), w2,
        perm.expert_offsets), args.iters), flops13 + flops2)
    row("path: w13+GLU -> w2", timed(lambda: gg.grouped_gemm(ggg.grouped_gemm_glu(
        x, w13, perm.expert_offsets, perm.sorted_token_ids), w2, perm.expert_offsets), args.iters), flops13 + flops2)
    write_json(args, T, H, I, E, k, rows)
    return 0


def write_json(args, T, H, I, E, k, rows) -> None:
    if args.json:
        import triton
        with open(args.json, "w") as f:
            json.dump({"machine": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                       "torch": torch.__version__, "triton": triton.__version__,
                       "shape": {"tokens": T, "hidden": H, "moe_intermediate": I, "experts": E, "k": k},
                       "records": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
