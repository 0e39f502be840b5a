"""KDA chunked prefill on the GPU: our KdaChunkPrefill kernel vs fla-core's chunk_kda (KdaChunkFla), same inputs,
same run, outputs and final states compared with each other and with the naive fp32 recurrence.

Run on the H200 from the repo root (fla-core and einops wheels in .whl/):
    python3 -m pip install --no-deps --target /tmp/site .whl/fla_core-*.whl .whl/einops-*.whl
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/kda_prefill_bench.py [--out benchmarks/results/kda_prefill_h200.json]
Prints a table and writes JSON: {machine, command, records}; one record per (heads, segments) shape with the
median time of each implementation (CUDA events, after a warm-up that also runs fla's autotuner), the ratio
ours / fla, and the relative RMS errors against the naive recurrence.
"""

from __future__ import annotations

import argparse
import sys

import torch
from _results import median_ms, write_results

from kestrel.catalog._op import validating
from kestrel.catalog.kda._common import make_kda_inputs
from kestrel.catalog.kda.chunk import KdaChunkPrefill
from kestrel.catalog.kda.chunk_fla import KdaChunkFla, rms_ratio
from kestrel.ops.kda import recurrence_varlen

SHAPES = [  # (heads, segment lengths, gate form, why)
    (32, (8192,), "kimi", "Kimi Linear 48B: one 8K prompt"),
    (32, (2048,) * 4, "kimi", "Kimi Linear 48B: 4 x 2K prompts"),
    (96, (8192,), "k3", "K3 tp1: one 8K prompt"),
    (96, (2048,) * 4, "k3", "K3 tp1: 4 x 2K prompts"),
]


def run_shape(H: int, lens: tuple[int, ...], gate: str, reps: int, check: bool) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(H * 1000 + len(lens))
    inp = make_kda_inputs(dict(lens=lens, H=H, D=128, gate=gate, dtype=torch.bfloat16), dev, gen)
    state0 = inp["state"].clone()

    def call(entry, state):
        return entry.raw_call(**{**inp, "state": state})

    results = {}
    for name, entry in (("ours", KdaChunkPrefill), ("fla", KdaChunkFla)):
        with validating(entry):            # is_valid once, on the exact inputs timed below
            o, st = call(entry, state0.clone())
        results[name] = (o, st)
        scratch = state0.clone()
        call(entry, scratch)                # warm-up (compiles; fla autotunes here)
        torch.cuda.synchronize()
        results[name + "_ms"] = median_ms(lambda: call(entry, scratch), reps)
    rec = dict(kernel="kda_chunk_prefill", heads=H, head_dim=128, tokens=sum(lens), segments=len(lens),
               gate=gate, dtype="bf16", ours_ms=results["ours_ms"], fla_ms=results["fla_ms"],
               ours_over_fla=results["ours_ms"] / results["fla_ms"],
               ours_vs_fla_o_rms=rms_ratio(results["ours"][0].float(), results["fla"][0].float()),
               ours_vs_fla_state_rms=rms_ratio(results["ours"][1], results["fla"][1]))
    if check:
        o_ref, st_ref = recurrence_varlen(**{**inp, "state": state0.clone()})
        for name in ("ours", "fla"):
            rec[f"{name}_o_rms_vs_ref"] = rms_ratio(results[name][0].float(), o_ref)
            rec[f"{name}_state_rms_vs_ref"] = rms_ratio(results[name][1], st_ref)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-check", action="store_true", help="skip the naive fp32 reference (slow at 96 heads)")
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kda_prefill_bench needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    records = []
    print(f"{'shape':<34} {'ours ms':>9} {'fla ms':>9} {'ours/fla':>9} {'o rms':>9} {'state rms':>10} "
          f"{'ours/ref':>9} {'fla/ref':>9}")
    for H, lens, gate, why in SHAPES:
        rec = run_shape(H, lens, gate, args.reps, not args.no_check)
        rec["why"] = why
        records.append(rec)
        print(f"{why:<34} {rec['ours_ms']:9.3f} {rec['fla_ms']:9.3f} {rec['ours_over_fla']:9.2f} "
              f"{rec['ours_vs_fla_o_rms']:9.2e} {rec['ours_vs_fla_state_rms']:10.2e} "
              f"{rec.get('ours_o_rms_vs_ref', float('nan')):9.2e} {rec.get('fla_o_rms_vs_ref', float('nan')):9.2e}",
              flush=True)
    write_results(records, args.out)


if __name__ == "__main__":
    main()
