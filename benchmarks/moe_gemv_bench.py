"""The bf16 experts' decode GEMVs (MoeGemvGlu on w13, MoeGemv on w2) against the grouped GEMMs they replace in
`Bf16Experts.small` (MoeGroupedGemmGlu, MoeGroupedGemm), on the GPU.

Run on the H200 from the repo root:
    PYTHONPATH=$PWD python3 benchmarks/moe_gemv_bench.py --json $OUT/moe_gemv.json
(JSON {machine, command, records}, benchmarks/_results.py; `--batches 1,2,4,8,16` adds batches, `--model k3` runs
K3's latent MoE widths instead of Kimi Linear 48B's (59 GB of weights), `--sweep` also times a grid of GEMV tile
configs (BN, BK, warps, stages) per case, each checked against the default's output, and reports the fastest.)

Each case routes T tokens at random over the routed experts (top-k distinct), plus Kimi Linear's shared expert
stacked as expert 256 on every token, as a decode step does, and times each launch with CUDA events around it,
the L2 flushed before each of 100 runs (median). TB/s counts the weight bytes a launch must read: the touched
experts' w13 (2I x K) or w2 (N x I) in bf16; activations and outputs are not counted. `of copy` divides by a
device-to-device copy's bandwidth measured in the same run ((read + write bytes) / time); the target is >= 85% of
HBM (4.2 TB/s nominal, the copy measures what is reachable).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from _results import write_results

from kestrel.catalog.moe.gemv import MoeGemv
from kestrel.catalog.moe.gemv_glu import MoeGemvGlu
from kestrel.catalog.moe.grouped_gemm import MoeGroupedGemm
from kestrel.catalog.moe.grouped_gemm_glu import MoeGroupedGemmGlu
from kestrel.catalog.moe.permute import permute_reference
from kestrel.kernels.moe.expert_gemv import expert_gemv, gemv_config, gemv_rows

HBM_TBS = 4.2
DEV = torch.device("cuda")
# model -> (routed experts, top-k, shared expert stacked, I, hidden / latent, activation)
MODELS = {"kl8": (256, 8, True, 1024, 2304, "silu"), "k3": (896, 16, False, 3072, 3584, "situ")}
SWEEP = [(bn, bk, w, st) for bn in (8, 16, 32) for bk in (128, 256, 512) for w in (4, 8) for st in (1, 2, 3, 4)]
_FLUSH = None


def _flush():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)      # > the H200's 50 MB L2
    _FLUSH.zero_()


def _time_us(fn, runs: int = 100) -> float:
    """Median microseconds of fn over `runs`, each with a cold L2, timed by CUDA events around the launch alone."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(runs):
        _flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _copy_tbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = _time_us(lambda: dst.copy_(src), runs=20)
    return 2 * src.numel() / (us * 1e-6) / 1e12


def _routing(T, E, k, shared, gen):
    ids = torch.rand((T, E), generator=gen).topk(k, dim=-1).indices.to(torch.int32)
    if shared:
        ids = torch.cat([ids, torch.full((T, 1), E, dtype=torch.int32)], dim=1)
    return permute_reference(ids.to(DEV), E + int(shared))


def _sweep(fn_for, default_out, compare) -> tuple[tuple, float]:
    """fn_for(config) runs the GEMV; the fastest config of the grid whose output passes `compare` against the default config's."""
    best = (None, float("inf"))
    for cfg in SWEEP:
        def fn(cfg=cfg):
            return fn_for(cfg)
        try:
            compare(fn(), default_out)
        except Exception as e:        # a config the compiler refuses (registers, shared memory) is skipped
            print(f"  sweep {cfg}: {type(e).__name__}", file=sys.stderr)
            continue
        us = _time_us(fn, runs=30)
        if us < best[1]:
            best = (cfg, us)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", choices=sorted(MODELS), default="kl8")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args(argv)
    E, k, shared, I, H, act = MODELS[args.model]
    Et = E + int(shared)
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn((Et, 2 * I, H), device=DEV, dtype=torch.bfloat16).mul_(2 * H ** -0.5)
    w2 = torch.randn((Et, H, I), device=DEV, dtype=torch.bfloat16).mul_(I ** -0.5)
    copy = _copy_tbs()
    print(f"device copy: {copy:.2f} TB/s (read + write)")
    print(f"{'case':<34} {'rows':>4} {'gemv us':>8} {'TB/s':>6} {'of copy':>7} {'grouped us':>10} {'TB/s':>6} "
          f"{'speedup':>7}  config")
    records = []
    for T in [int(b) for b in args.batches.split(",")]:
        perm = _routing(T, E, k, shared, gen)
        offs, ids = perm.expert_offsets, perm.sorted_token_ids
        touched = int((offs[1:] > offs[:-1]).sum())
        x = torch.randn((T, H), device=DEV, dtype=torch.bfloat16)
        h = MoeGroupedGemmGlu.raw_call(x, w13, offs, ids, act)
        rows = gemv_rows(T)
        cases = [
            ("w13 + GLU", 2 * I * H, MoeGemvGlu, MoeGroupedGemmGlu,
             lambda cfg=None: expert_gemv(x, w13, offs, T, ids, glu=True, act=act, config=cfg),
             lambda: MoeGroupedGemmGlu.raw_call(x, w13, offs, ids, act), gemv_config(True, rows, I, H)),
            ("w2", H * I, MoeGemv, MoeGroupedGemm,
             lambda cfg=None: expert_gemv(h, w2, offs, T, config=cfg),
             lambda: MoeGroupedGemm.raw_call(h, w2, offs), gemv_config(False, rows, H, I)),
        ]
        for what, per_expert, entry, base, gemv, grouped, cfg in cases:
            out, ref = gemv(), grouped()
            entry.compare(out, ref)            # the two paths agree before either is timed
            nbytes = touched * per_expert * 2
            us, base_us = _time_us(gemv), _time_us(grouped)
            tbs, base_tbs = nbytes / (us * 1e-6) / 1e12, nbytes / (base_us * 1e-6) / 1e12
            rec = dict(model=args.model, T=T, op=what, rows=rows, experts=touched, weight_bytes=nbytes,
                       gemv_us=us, gemv_tbs=tbs, of_copy=tbs / copy, of_hbm=tbs / HBM_TBS, grouped_us=base_us,
                       grouped_tbs=base_tbs, speedup=base_us / us, config=list(cfg), copy_tbs=copy)
            if args.sweep:
                best, best_us = _sweep(gemv, out, entry.compare)
                rec.update(sweep_best=list(best) if best else None, sweep_us=best_us,
                           sweep_tbs=nbytes / (best_us * 1e-6) / 1e12 if best else None)
            records.append(rec)
            name = f"{args.model} bs{T} {what} ({touched} experts)"
            line = (f"{name:<34} {rows:>4} {us:>8.1f} {tbs:>6.2f} {tbs / copy:>7.0%} {base_us:>10.1f} "
                    f"{base_tbs:>6.2f} {base_us / us:>6.2f}x  {cfg}")
            if args.sweep and rec["sweep_best"]:
                line += f"  best {tuple(rec['sweep_best'])}: {rec['sweep_us']:.1f} us {rec['sweep_tbs']:.2f} TB/s"
            print(line, flush=True)
    write_results(records, args.json)


if __name__ == "__main__":
    main()
