"""Shared memory of the MLA attention kernels' GPU launches, by compiling them for sm_90 without a GPU.

    PYTHONPATH=<a Triton with its NVIDIA backend>:$PWD python benchmarks/sm90_smem.py decode --entry MlaDecodeFp8
    PYTHONPATH=...:$PWD python benchmarks/sm90_smem.py prefill --entry MlaPrefillFp8
    PYTHONPATH=...:$PWD python benchmarks/sm90_smem.py decode --entry MlaDecodeNvfp4 --q-dtype fp32

For every sm_90 cell of the entries named (all decode / prefill entries by default), the host code runs on 'meta'
tensors of the cell's shapes with the config it picks on a 132-SM H200; the kernel launch is recorded instead of
made, and compiled for GPUTarget("cuda", 90, 32) with the runtime's specialization (ints equal to 1 become
constexprs, multiples of 16 and every pointer are marked divisible by 16). One JSON line per launch: the tile
constexprs, warps, stages, `metadata.shared` and whether it fits sm_90's 232448 bytes (227 KiB) a CTA. A failed
compile (an invalid tl.dot shape, say) prints its error. Use the Triton version the GPU runs (3.6 on the H200):
shared memory depends on the compiler. Each real-width compile takes 10-20 s of one core.
"""

from __future__ import annotations

import argparse
import inspect
import json

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

SM90_SHARED = 232448
H200_SMS = 132
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}
_launches = []


def _record(self, *args, grid, warmup, **kwargs):
    _launches.append((self, args, kwargs))


def _compile(kernel, args, kwargs) -> dict:
    kw = dict(kwargs)
    warps, stages = kw.pop("num_warps", 4), kw.pop("num_stages", 3)
    params = inspect.signature(kernel.fn).parameters
    bound = {**dict(zip(params, args)), **kw}
    sig, attrs, const = {}, {}, {}
    for i, (name, p) in enumerate(params.items()):
        v = bound[name]
        if p.annotation is tl.constexpr or "constexpr" in str(p.annotation):
            sig[name], const[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name], attrs[(i,)] = "*" + _TYPES[v.dtype], [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1:
            sig[name], const[name] = "constexpr", 1
        else:
            sig[name] = "i64" if abs(v) >= 2 ** 31 else "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    tiles = {k: v for k, v in const.items() if k.startswith("BLOCK") or k in ("FMT", "FP8", "D1", "D2")}
    row = dict(kernel=kernel.fn.__name__, warps=warps, stages=stages, tiles=tiles)
    try:
        k = triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=stages))
        row.update(shared=k.metadata.shared, fits=k.metadata.shared <= SM90_SHARED)
    except Exception as e:  # a compile error is the answer here, not a crash of the tool
        row.update(fits=False, error=f"{type(e).__name__}: {str(e)[-400:]}")
    return row


def _flush(cell: str) -> None:
    for kernel, args, kwargs in _launches:
        print(json.dumps({"cell": cell, **_compile(kernel, args, kwargs)}, default=str), flush=True)
    _launches.clear()


def _gpu_configs(module) -> None:
    """The module's host code picks its GPU config and dot flags for 'meta' tensors too."""
    cfg, flags = module._config, module.dot_flags
    module._config = lambda device, *a: cfg(torch.device("cuda", 0), *a)
    module.dot_flags = lambda dtype, device: flags(dtype, torch.device("cuda", 0))
    if hasattr(module, "_sm_count"):
        module._sm_count = lambda index: H200_SMS


def decode(entries: list[str], q_dtype: torch.dtype | None) -> None:
    import kestrel.kernels.attention.mla_decode as md
    from kestrel.catalog.attention.mla_decode import MlaDecode
    from kestrel.catalog.attention.mla_decode_fp8 import MlaDecodeFp8
    from kestrel.catalog.attention.mla_decode_nvfp4 import MlaDecodeNvfp4
    from kestrel.quant.kv_cache import KvPageFormat
    _gpu_configs(md)
    meta = torch.device("meta")
    for entry in (MlaDecode, MlaDecodeFp8, MlaDecodeNvfp4):
        if entries and entry.__name__ not in entries:
            continue
        kind = getattr(entry, "KIND", "")
        for i, cell in enumerate(entry.CELLS):
            if "sm_90" not in cell.archs:
                continue
            s = cell.spec
            L, R, H, ps, dtype = s["kv_lora_rank"], s["rope_dim"], s["heads"], s["page_size"], q_dtype or s["dtype"]
            ctx = s["ctx"]
            batch = len(ctx) if isinstance(ctx, tuple) else int(s.get("batch", 1))
            T = batch * int(s.get("tokens_per_req", 1))
            pages = -(-(max(ctx) if isinstance(ctx, tuple) else ctx) // ps)
            fmt = KvPageFormat(kind, L, R) if kind else None
            kv = torch.empty(batch * pages, ps, fmt.row_bytes if fmt else L + R,
                             dtype=torch.uint8 if fmt else dtype, device=meta)
            q = torch.empty(T, H, L + R, dtype=dtype, device=meta)
            idx = torch.empty(T, dtype=torch.int32, device=meta)
            md.mla_decode(q, kv, torch.empty(batch, pages, dtype=torch.int32, device=meta), idx, idx,
                          s["d_qk"] ** -0.5, L, int(s["num_splits"]), fmt=fmt)
            _flush(f"{entry.__name__}[{i}] T={T} H={H} splits={s['num_splits']} q={dtype}")


def prefill(entries: list[str], q_dtype: torch.dtype | None) -> None:
    import kestrel.kernels.attention.mla_prefill as mp
    from kestrel.catalog.attention.mla_prefill import MlaPrefill
    from kestrel.catalog.attention.mla_prefill_fp8 import MlaPrefillFp8
    _gpu_configs(mp)
    meta = torch.device("meta")
    for entry in (MlaPrefill, MlaPrefillFp8):
        if entries and entry.__name__ not in entries:
            continue
        fp8 = entry is MlaPrefillFp8
        for i, cell in enumerate(entry.CELLS):
            if "sm_90" not in cell.archs:
                continue
            s = cell.spec
            H, dqk, dv = s["heads"], s["d_nope"] + s["d_rope"], s["d_v"]
            ql = s["q_lens"]
            kl = s.get("k_lens", ql)
            dtype = torch.float8_e4m3fn if fp8 else (q_dtype or s["dtype"])
            q = torch.empty(sum(ql), H, dqk, dtype=dtype, device=meta)
            k = torch.empty(sum(kl), H, dqk, dtype=dtype, device=meta)
            v = torch.empty(sum(kl), H, dv, dtype=dtype, device=meta)
            cu = torch.empty(len(ql) + 1, dtype=torch.int32, device=meta)
            sc = torch.empty(1, dtype=torch.float32, device=meta)
            mp.mla_prefill(q, k, v, cu, cu, dqk ** -0.5, fp8_scales=(sc,) * 3 if fp8 else None,
                           out_dtype=s["dtype"])
            _flush(f"{entry.__name__}[{i}] H={H} d_qk={dqk} d_v={dv} {dtype}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=("decode", "prefill"))
    ap.add_argument("--entry", action="append", default=[], help="catalog entry class name (repeatable)")
    ap.add_argument("--q-dtype", choices=("bf16", "fp32"), help="override the cells' query dtype")
    a = ap.parse_args()
    JITFunction.run = _record
    q_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[a.q_dtype]
    (decode if a.kernel == "decode" else prefill)(a.entry, q_dtype)


if __name__ == "__main__":
    main()
