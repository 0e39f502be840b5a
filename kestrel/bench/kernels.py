"""`kestrel bench kernels`: every GPU cell of the catalog, timed, against its floor and its baseline library.

For each entry and each cell certified for this machine's architecture (`--include-tiny` adds the tiny cells; on
the CPU only those run, timed with a wall clock under the Triton interpreter, which says nothing about speed):
- time: `triton.testing.do_bench` (CUDA events, median) of `raw_call` on the cell's inputs;
- floor: max(bytes moved / HBM bandwidth, flops / bf16 tensor rate), H200 4.2 TB/s and 770 TFLOP/s by default.
  Bytes: every input read once and every output written once, except the pools a call only touches in part
  (KDA state slots of its requests, MLA pages of its context, routed experts its tokens chose), counted as touched;
- baseline: the library op for the same work where one exists (cuBLAS via torch.mm / bmm for GEMMs, torch SDPA
  for single-sequence MLA prefill, fla's `chunk_kda` for KDA chunked prefill when fla is importable).
The JSON report is `{"machine", "command", "records"}`, one record per cell.
"""

from __future__ import annotations

import time

import torch

from kestrel.bench.latency import BF16_FLOPS_PER_S, HBM_BYTES_PER_S, _table, command_line, machine_info


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _rows_touched(t: torch.Tensor, rows: int) -> int:
    return rows * (t[0].numel() * t.element_size() if t.shape[0] else 0)


def bytes_moved(inputs: dict, out) -> int:
    """Bytes a call must move at least: its inputs once, its outputs once, pools only where touched."""
    total = 0
    for name, t in inputs.items():
        if not isinstance(t, torch.Tensor):
            continue
        if name in ("state", "conv_state") and "slots" in inputs:
            total += 2 * _rows_touched(t, inputs["slots"].numel())             # read and written
        elif name == "kv_cache":
            W = t.shape[-1] * t.element_size()
            if "kv_lens" in inputs:                                              # decode: each request's context
                per_req: dict[int, int] = {}
                for r, n in zip(inputs["req_idx"].tolist(), inputs["kv_lens"].tolist()):
                    per_req[r] = max(per_req.get(r, 0), n)
                total += W * sum(per_req.values())
            elif "positions" in inputs:                                          # cache write
                total += W * int((inputs["positions"] >= 0).sum())
            elif "row_index" in inputs:                                          # gather
                total += W * inputs["row_index"].numel()
            else:
                total += _nbytes(t)
        elif name in ("w13", "w2") and "topk_ids" in inputs:
            total += _rows_touched(t, int(inputs["topk_ids"].unique().numel()))
        elif name == "w" and "expert_offsets" in inputs:
            offs = inputs["expert_offsets"].long()
            total += _rows_touched(t, int((offs[1:] > offs[:-1]).sum()))
        else:
            total += _nbytes(t)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    ptrs = {t.data_ptr() for t in inputs.values() if isinstance(t, torch.Tensor)}
    total += sum(_nbytes(o) for o in outs if isinstance(o, torch.Tensor) and o.data_ptr() not in ptrs)
    return total


def flops_of(entry: str, inputs: dict) -> float:
    """Multiply-adds x 2 of the cell's math (0 for copies and elementwise work: those are bound by bytes)."""
    i = inputs
    if entry in ("Linear", "LmHead"):
        return 2.0 * i["x"].shape[0] * i["x"].shape[1] * i["weight"].shape[0]
    if entry == "HeadBmm":
        T, H, K = i["x"].shape
        return 2.0 * T * H * K * i["w"].shape[-1]
    if entry == "MoeRouter":
        return 2.0 * i["x"].shape[0] * i["x"].shape[1] * i["weight"].shape[0]
    if entry == "MoeExperts":
        T, k = i["topk_ids"].shape
        E, I2, H = i["w13"].shape
        return 2.0 * T * k * (I2 * H + H * I2 // 2)
    if entry == "GroupedGemm":
        S = i["sorted_token_ids"].numel() if i.get("sorted_token_ids") is not None else i["x"].shape[0]
        return 2.0 * S * i["w"].shape[1] * i["w"].shape[2]
    if entry in ("MlaPrefill", "MlaPrefillFp8"):
        H, dqk, dv = i["q"].shape[1], i["q"].shape[2], i["v"].shape[2]
        cq, ck = i["cu_seqlens_q"].tolist(), i["cu_seqlens_k"].tolist()
        pairs = 0
        for b in range(len(cq) - 1):
            nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            pairs += nq * nk - nq * (nq - 1) // 2                 # causal, queries at the end of their keys
        return 2.0 * H * (dqk + dv) * pairs
    if entry in ("MlaDecode", "MlaDecodeFp8", "MlaDecodeNvfp4"):
        T, H, W = i["q"].shape
        return 2.0 * H * (W + i["kv_lora_rank"]) * float(i["kv_lens"].sum())
    if entry in ("KdaChunkPrefill", "KdaRecurrent"):
        T, H, D = i["q"].shape
        return 6.0 * T * H * D * D
    return 0.0


def baseline(entry: str, inputs: dict):
    """(library name, callable) doing the cell's work with a library op, or None."""
    i = inputs
    if entry in ("Linear", "LmHead"):
        x, w = i["x"], i["weight"]
        return "cuBLAS (torch.mm)", lambda: torch.mm(x, w.t())
    if entry == "HeadBmm":
        x, w = i["x"], i["w"]
        return "cuBLAS (torch.bmm)", lambda: torch.bmm(x.transpose(0, 1), w)
    if entry == "MlaPrefill" and i["cu_seqlens_q"].numel() == 2 and i["q"].shape[0] == i["k"].shape[0]:
        from kestrel.catalog.attention.mla_prefill import whole_keys
        k = whole_keys(i["k"], i.get("k_rope"))
        q, k, v = (t.transpose(0, 1)[None] for t in (i["q"], k, i["v"]))
        return "torch SDPA", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                       scale=i["scale"])
    if entry == "KdaChunkPrefill":
        from kestrel.kernels.kda.fla_chunk import import_chunk_kda
        try:
            chunk_kda = import_chunk_kda(i["q"].device)
        except ImportError:
            return None
        cu = i["cu_seqlens"].long()
        h0 = i["state"][i["slots"].long()].contiguous()
        args = {n: i[n][None] for n in ("q", "k", "v", "g", "beta")}
        return "fla chunk_kda", lambda: chunk_kda(**args, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    return None


def _time(fn, device: torch.device, reps: int) -> float:
    """Seconds per call: CUDA events (do_bench's median) on a GPU, the best of `reps` wall-clock calls on the CPU."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def cells_to_run(device: torch.device, include_tiny: bool, names: list[str] | None):
    from kestrel.catalog import all_entries
    from kestrel.catalog._op import Arch, current_arch
    arch = current_arch(device)
    for entry in all_entries():
        if names and entry.__name__ not in names:
            continue
        if arch not in entry.ARCHS:
            continue
        for cell in entry.CELLS:
            if arch not in cell.archs:
                continue
            if device.type != "cpu" and not include_tiny and Arch.CPU in cell.archs:     # a tiny cell
                continue
            yield entry, cell


def run_kernels(device: torch.device, include_tiny: bool = False, names: list[str] | None = None, reps: int = 3,
                hbm: float = HBM_BYTES_PER_S, flops: float = BF16_FLOPS_PER_S, progress=None) -> dict:
    records = []
    for entry, cell in cells_to_run(device, include_tiny, names):
        name = entry.__name__
        inputs = entry.make_inputs(cell.spec, device, torch.Generator().manual_seed(0))
        rec = {"entry": name, "cell": cell.why}
        try:
            out = entry.raw_call(**inputs)
            rec["bytes"] = bytes_moved(inputs, out)
            rec["flops"] = flops_of(name, inputs)
            del out
            rec["time_us"] = 1e6 * _time(lambda: entry.raw_call(**inputs), device, reps)
        except Exception as e:          # one failing cell must not hide the others' numbers
            rec["error"] = f"{type(e).__name__}: {e}"
            records.append(rec)
            continue
        floor = max(rec["bytes"] / hbm, rec["flops"] / flops)
        rec["floor_us"] = 1e6 * floor
        rec["of_floor"] = rec["floor_us"] / rec["time_us"] if rec["time_us"] else None
        base = baseline(name, inputs)
        if base is not None:
            rec["baseline"] = base[0]
            try:
                rec["baseline_us"] = 1e6 * _time(base[1], device, reps)
                rec["vs_baseline"] = rec["baseline_us"] / rec["time_us"]
            except Exception as e:
                rec["baseline_error"] = f"{type(e).__name__}: {e}"
        records.append(rec)
        if progress is not None:
            progress(rec)
    return {"machine": machine_info(device), "command": command_line(), "records": records}


def format_table(report: dict) -> str:
    cols = ["entry", "cell", "us", "floor us", "of floor", "baseline", "base us", "speedup"]
    rows = []
    for r in report["records"]:
        if "error" in r:
            rows.append([r["entry"], r["cell"][:60], "error", "", "", r["error"][:40], "", ""])
            continue
        rows.append([r["entry"], r["cell"][:60], f"{r['time_us']:.4g}", f"{r['floor_us']:.3g}",
                     f"{r['of_floor']:.0%}", r.get("baseline", ""),
                     f"{r['baseline_us']:.1f}" if "baseline_us" in r else r.get("baseline_error", "")[:20],
                     f"{r['vs_baseline']:.2f}x" if "vs_baseline" in r else ""])
    return _table(cols, rows)


def register_kernels(bsub) -> None:
    p = bsub.add_parser("kernels", help="every GPU cell of the catalog: time, floor, ratio, baseline library",
                        description="Time every catalog cell certified for this GPU against its HBM / math floor "
                                    "and the baseline library (cuBLAS, SDPA, fla) where one exists.")
    p.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu (the CPU runs tiny cells only)")
    p.add_argument("--entry", action="append", help="only this entry (class name; repeatable)")
    p.add_argument("--include-tiny", action="store_true", help="also the tiny cells (always on the CPU)")
    p.add_argument("--reps", type=int, default=3, help="CPU: wall-clock repetitions per cell (best counts)")
    p.add_argument("--hbm-tb-s", type=float, default=HBM_BYTES_PER_S / 1e12, help="floor: HBM TB/s (H200 4.2)")
    p.add_argument("--tflops", type=float, default=BF16_FLOPS_PER_S / 1e12, help="floor: bf16 TFLOP/s (H200 770)")
    p.add_argument("--out", default="bench-kernels.json", help="JSON report path")
    p.set_defaults(func=cmd_kernels)


def cmd_kernels(args) -> int:
    import logging

    from kestrel.bench.throughput import write_report
    from kestrel.errors import KestrelError
    from kestrel.llm import resolve_device
    if args.reps < 1:
        raise KestrelError("--reps must be >= 1")
    device = resolve_device(args.device)
    log = logging.getLogger("kestrel.bench")
    report = run_kernels(device, args.include_tiny, args.entry, args.reps, args.hbm_tb_s * 1e12, args.tflops * 1e12,
                         progress=lambda r: log.info("%s: %s  %.1f us", r["entry"], r["cell"][:50], r["time_us"]))
    if not report["records"]:
        raise KestrelError(f"no catalog cell runs on {device} with these options (on the CPU pass --include-tiny)")
    print(format_table(report))
    write_report(report, args.out)
    log.info("wrote %s", args.out)
    return 0
