"""Time the decode / verify MoE permute (MoePermuteSmall, one launch) against MoePermute (four launches) measured in
the same run, at Kimi Linear's routing: 256 experts top-8 plus the shared expert (E' = 257).

    python benchmarks/permute_bench.py [--tokens 1 8 64 256 910] [--reps 100] [--json out.json]

For each batch T (S = T*(k+1) slots; T = 256 is a verify step of 64 sequences x 4, T = 910 the MAX_SLOTS edge) and
for shared = True / False: the median of --reps CUDA-event timings of one call, eagerly and replayed from a CUDA
graph holding that one call (a decode step replays its permute from a graph). MoePermute runs on the same ids with
the shared column appended (what MoePermuteSmall(shared=True) sorts). Each output is checked against the
reference once before timing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import median_ms, write_results  # noqa: E402
from kestrel.catalog.moe.permute import MoePermute  # noqa: E402
from kestrel.catalog.moe.permute_small import MoePermuteSmall, with_shared  # noqa: E402

E, K = 256, 8


def _median_us(fn, reps: int, graph: bool) -> float:
    """Median of `reps` event timings of fn(), or of replays of a CUDA graph capturing one fn() call."""
    fn()
    torch.cuda.synchronize()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    return 1e3 * median_ms(fn, reps, warmup=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 910])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--json", default=None, help="write the records to this JSON file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("permute_bench needs a CUDA device")
    records = []
    print(f"{'T':>5} {'shared':>6} {'S':>6} {'small eager us':>15} {'small graph us':>15} {'4-launch eager us':>18} "
          f"{'4-launch graph us':>18}")
    for T in args.tokens:
        for shared in (True, False):
            spec = dict(T=T, E=E, k=K, shared=shared)
            inp = MoePermuteSmall.make_inputs(spec, "cuda", torch.Generator().manual_seed(T))
            ref = MoePermuteSmall.reference(**inp)
            MoePermuteSmall.compare(MoePermuteSmall.raw_call(**inp), ref)
            ids, n_exp = inp["topk_ids"], E
            if shared:
                ids, _ = with_shared(inp["topk_ids"], inp["topk_weights"], E)
                ids, n_exp = ids.contiguous(), E + 1
            MoePermute.compare(MoePermute.raw_call(ids, n_exp), ref[0])
            small = lambda: MoePermuteSmall.raw_call(**inp)         # noqa: E731
            four = lambda: MoePermute.raw_call(ids, n_exp)           # noqa: E731
            rec = dict(T=T, shared=shared, S=T * (K + int(shared)), experts=n_exp,
                       small_eager_us=_median_us(small, args.reps, False),
                       small_graph_us=_median_us(small, args.reps, True),
                       four_launch_eager_us=_median_us(four, args.reps, False),
                       four_launch_graph_us=_median_us(four, args.reps, True))
            records.append(rec)
            print(f"{T:>5} {str(shared):>6} {rec['S']:>6} {rec['small_eager_us']:15.2f} {rec['small_graph_us']:15.2f} "
                  f"{rec['four_launch_eager_us']:18.2f} {rec['four_launch_graph_us']:18.2f}", flush=True)
    write_results(records, args.json)


if __name__ == "__main__":
    main()
