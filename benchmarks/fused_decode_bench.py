"""The fused decode entries against the launch sequences they replace, on the GPU, at decode widths.

For each pair: eager time (CUDA events, host launch cost included) and CUDA-graph time (GPU time, launches
replayed), same inputs (each entry's own GPU-cell `make_inputs`), so the ratio is measured in one run.
Run on the H200 from the repo root:  PYTHONPATH=$PWD python3 benchmarks/fused_decode_bench.py [--out FILE.json]
Prints a table and writes JSON {machine, command, records}.
"""

from __future__ import annotations

import argparse
import sys

import torch
from _results import write_results

from kestrel.catalog.attention.mla_cache_write import MlaCacheWrite
from kestrel.catalog.attention.mla_norm_cache_write import MlaNormCacheWrite
from kestrel.catalog.kda.conv import ShortConv
from kestrel.catalog.kda.decode import KdaDecode
from kestrel.catalog.kda.gate import KdaGate
from kestrel.catalog.kda.recurrent import KdaRecurrent
from kestrel.catalog.moe.combine import MoeCombine
from kestrel.catalog.moe.combine_norm import MoeCombineRmsNorm
from kestrel.catalog.moe.glu import SiluGlu, SituGlu
from kestrel.catalog.moe.grouped_gemm import MoeGroupedGemm
from kestrel.catalog.moe.grouped_gemm_glu import MoeGroupedGemmGlu
from kestrel.catalog.moe.permute import MoePermute
from kestrel.catalog.moe.permute_small import MoePermuteSmall
from kestrel.catalog.moe.router import MoeRouter
from kestrel.catalog.moe.router_bf16 import MoeRouterBf16
from kestrel.catalog.norm.add_mix_rmsnorm import AddMixRmsNorm
from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm
from kestrel.catalog.norm.attn_res_mix import AttnResMix
from kestrel.catalog.norm.gated_rmsnorm import GatedRmsNorm


def kda_today(mixed, f, b, gate, conv_weight, conv_state, rec_state, slots, A_log, dt_bias, norm_weight, eps,
              lower_bound=None, pad_slot=-1, out=None):
    """catalog/_layers.kda's decode launches for the same rows (cu_seqlens built outside the timed region)."""
    H, D = A_log.numel(), norm_weight.numel()
    qkv, _ = ShortConv.raw_call(mixed, conv_weight, conv_state, _CU[slots.numel()], slots)
    q, k, v = (t.view(-1, H, D) for t in qkv.split(H * D, dim=-1))
    g, beta = KdaGate.raw_call(f, A_log, dt_bias, b, lower_bound)
    o, _ = KdaRecurrent.raw_call(q, k, v, g, beta, rec_state, _CU[slots.numel()], slots)
    return GatedRmsNorm.raw_call(o.view(-1, D), gate.reshape(-1, D), norm_weight, eps)


_CU: dict[int, torch.Tensor] = {}


def mix_today(delta, partial, blocks, w, norm_weight, eps, out=None, r_out=None):
    partial.add_(delta)
    return AddRmsNorm.raw_call(AttnResMix.raw_call(blocks, partial, w, eps), None, norm_weight, eps)


def glu_today(x, w13, expert_offsets, sorted_token_ids, act="silu", beta=4.0, linear_beta=25.0, out=None):
    gu = MoeGroupedGemm.raw_call(x, w13, expert_offsets, sorted_token_ids)
    return SiluGlu.raw_call(gu) if act == "silu" else SituGlu.raw_call(gu, beta, linear_beta)


def combine_today(y, topk_weights, slot_to_sorted, norm_weight, eps, out=None):
    return AddRmsNorm.raw_call(MoeCombine.raw_call(y, topk_weights, slot_to_sorted), None, norm_weight, eps)


def permute_today(topk_ids, num_experts, topk_weights=None, shared=False):
    return MoePermute.raw_call(topk_ids, num_experts)


def norm_cache_today(kv, norm_weight, eps, kv_cache, block_tables, req_idx, positions):
    L = norm_weight.numel()
    latent, _ = AddRmsNorm.raw_call(kv[:, :L], None, norm_weight, eps)
    return MlaCacheWrite.raw_call(latent, kv[:, L:], kv_cache, block_tables, req_idx, positions)


def router_today(**inp):
    return MoeRouter.raw_call(**inp)


# (fused entry, the sequence it replaces, launches before -> after)
PAIRS = [
    (KdaDecode, kda_today, "5 -> 1"),
    (AddMixRmsNorm, mix_today, "3 -> 1"),
    (MoePermuteSmall, permute_today, "4 -> 1"),
    (MoeGroupedGemmGlu, glu_today, "2 -> 1"),
    (MoeRouterBf16, router_today, "4 -> 2"),
    (MoeCombineRmsNorm, combine_today, "2 -> 1"),
    (MlaNormCacheWrite, norm_cache_today, "2 -> 1"),
]


def _event_ms(fn, reps: int) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def _graph_ms(fn, reps: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                                  # warm-up outside capture (compiles)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    return _event_ms(graph.replay, max(1, reps // 10)) / 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fused_decode_bench needs a CUDA GPU")
    dev = torch.device("cuda")
    records = []
    print(f"{'entry':<20} {'cell':<70} {'launches':>9} {'eager old':>10} {'eager new':>10} {'graph old':>10} "
          f"{'graph new':>10}")
    for entry, today, launches in PAIRS:
        for i, cell in enumerate(entry.CELLS):
            if "sm_90" not in cell.archs or cell.spec.get("pad") or cell.spec.get("shared"):
                continue                      # the old sequence has no padding rows / shared slot
            inp = entry.make_inputs(cell.spec, dev, torch.Generator().manual_seed(i))
            if entry is KdaDecode:
                B = inp["slots"].numel()
                _CU.setdefault(B, torch.arange(B + 1, dtype=torch.int32, device=dev))
            if entry is AddMixRmsNorm and inp["delta"] is None:
                continue
            if entry is MoePermuteSmall:
                inp = {k: v for k, v in inp.items() if k in ("topk_ids", "num_experts")}
            new = lambda: entry.raw_call(**inp)                          # noqa: E731
            old = lambda: today(**inp)                                   # noqa: E731
            rec = dict(entry=entry.__name__, cell=cell.why, launches=launches,
                       eager_old_ms=_event_ms(old, args.reps), eager_new_ms=_event_ms(new, args.reps),
                       graph_old_ms=_graph_ms(old, args.reps), graph_new_ms=_graph_ms(new, args.reps))
            records.append(rec)
            print(f"{rec['entry']:<20} {cell.why[:70]:<70} {launches:>9} {rec['eager_old_ms']:10.4f} "
                  f"{rec['eager_new_ms']:10.4f} {rec['graph_old_ms']:10.4f} {rec['graph_new_ms']:10.4f}",
                  flush=True)
            del inp, new, old                 # a K3 expert stack is 39 GB: free it before the next cell's
            torch.cuda.empty_cache()
    write_results(records, args.out)


if __name__ == "__main__":
    main()
