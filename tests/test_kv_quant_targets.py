"""The sm_90 targets over quantized MLA pages (`--kv-cache-dtype fp8|nvfp4`, `--kv-cache-dtype-layers`): per layer by
its page format, the latent is normalized then quantized into the pages (MlaCacheWriteFp8 / Nvfp4), decode reads
them directly (MlaDecodeFp8 / Nvfp4) and prefill reads dequantized context rows (MlaGatherDequant).

Each case runs the reference implementation and the target over pools with the same page formats (from the engine
flags, as the engine makes them): teacher-forced logits of an 18-token prefill (the expanded form) then decode steps
(the absorbed form) agree, and the pages hold the same bytes. On the CPU everything runs in fp32 (the Triton
interpreter); the two compute the latent in another summation order, which shows only in the fp32 scales' last
bits (checked within 1e-5), never in a code (the cases are seeded: a code on a rounding tie would show)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from helpers import scratch_dir
from helpers import single_thread  # noqa: F401  (autouse)

from kestrel import contract
from kestrel.config import EngineConfig, ModelConfig
from kestrel.models.kimi import load_reference_model
from kestrel.models.kimi.checkpoint import make_checkpoint
from kestrel.models.kimi.routing import ModelingContext, explain, route
from kestrel.models.kimi.step import CachePools, StepBatch
from kestrel.runtime.memory import cache_formats

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TARGETS = {"k3-tiny": "kimi_k3_bf16__sm_90__default", "kimi-linear-tiny": "kimi_linear_bf16__sm_90__default"}

# (preset, layers (None: the preset's own), --kv-cache-dtype, --kv-cache-dtype-layers, the layers' page kinds)
CASES = [("kimi-linear-tiny", None, "fp8", None, {1: "fp8", 3: "fp8"}),
         ("kimi-linear-tiny", None, "nvfp4", None, {1: "nvfp4", 3: "nvfp4"}),
         ("kimi-linear-tiny", None, "fp8", "3:nvfp4", {1: "fp8", 3: "nvfp4"}),
         ("k3-tiny", 4, "fp8", None, {3: "fp8"}),
         ("k3-tiny", 4, "nvfp4", None, {3: "nvfp4"})]


def _forced(model, config, formats, prompt, tokens):
    """(fp32 logits of a prefill of `prompt` then one decode step per forced token, the pools after them)."""
    pools = CachePools.allocate(config, num_pages=8, page_size=16, num_slots=1, dtype=DTYPE, device=DEVICE,
                                kv_formats=formats)
    table = torch.arange(8, dtype=torch.int32, device=DEVICE).view(1, 8)
    slot = torch.zeros(1, dtype=torch.long, device=DEVICE)
    n = len(prompt)
    out = [model(StepBatch(torch.tensor(prompt, device=DEVICE), torch.arange(n, device=DEVICE), [0, n], [0], slot,
                           table, torch.tensor([n - 1], device=DEVICE)), pools)]
    for i, t in enumerate(tokens):
        pos = n + i
        out.append(model(StepBatch(torch.tensor([t], device=DEVICE), torch.tensor([pos], device=DEVICE), [0, 1],
                                   [pos], slot, table, torch.tensor([0], device=DEVICE)), pools))
    return torch.cat(out).float(), pools


@pytest.mark.parametrize("preset, layers, kv, per_layer, kinds", CASES)
def test_target_over_quantized_pages_matches_the_reference(preset, layers, kv, per_layer, kinds):
    path = make_checkpoint(preset, os.path.join(scratch_dir(f"kvq-{preset}"), "m"), layers=layers, seed=7,
                           dtype=torch.float32, with_tokenizer=False)
    config = ModelConfig.from_dir(path)
    ec = EngineConfig(model=path, kv_cache_dtype=kv, kv_cache_dtype_layers=per_layer)
    formats, _ = cache_formats(config, ec, DTYPE)
    assert {i: f.kind for i, f in formats.items()} == kinds
    ref = load_reference_model(path, config, DTYPE, DEVICE)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, config.vocab_size, (18,), generator=gen).tolist()     # > MAX_VERIFY: expanded form
    forced = torch.randint(0, config.vocab_size, (2,), generator=gen).tolist()      # 2 decode steps, page 2
    want, ref_pools = _forced(ref, config, formats, prompt, forced)
    target = importlib.import_module(f"kestrel.models.kimi.targets.{TARGETS[preset]}.modeling").build(ref, config)
    got, pools = _forced(target, config, formats, prompt, forced)
    for i, fmt in formats.items():
        a, b = pools.mla[i], ref_pools.mla[i]
        assert a.dtype == b.dtype == torch.uint8 and fmt.matches(a)
        written = fmt.views(b)["scale"].ne(0).any(-1)
        assert int(written.sum()) == len(prompt) + len(forced)
        if DTYPE == torch.float32:
            # k_pe, the e4m3 / e2m1 codes and the block scales byte for byte, the pad bytes and unwritten rows too,
            # except where the latent's fp32 summation order (a few ulps, which grow through the layers: CPU BLAS
            # kernels differ by shape and by machine) puts a value across a rounding boundary: such a byte is one
            # code off, so at most 1 in 1,000 differ and the decoded rows agree to 1e-2 (a page written to the
            # wrong row or with a wrong scale differs in most bytes); the fp32 scales (amax / 448 ...): a few ulps
            differ = a[..., fmt.pe_offset:].ne(b[..., fmt.pe_offset:]).float().mean().item()
            assert differ <= 1e-3, (i, fmt.kind, differ)
            da, db = fmt.decode(a)[written].float(), fmt.decode(b)[written].float()
            assert ((da - db).norm() / db.norm()) < 1e-2, (i, fmt.kind)
            torch.testing.assert_close(fmt.views(a)["scale"], fmt.views(b)["scale"], rtol=1e-5, atol=0)
        else:
            # bf16: the latent entering the write already carries the two models' bf16 spread of the layers below
            # (the write itself is certified bit for bit by the MlaCacheWrite cells), so the pages are compared as
            # values: rows written, in place, of the right magnitude. Measured in bf16 under the interpreter: 0.02 to
            # 0.34 relative (the deeper the layer, the more); pages in the wrong rows or scales read ~1.4.
            da, db = fmt.decode(a)[written].float(), fmt.decode(b)[written].float()
            assert ((da - db).norm() / db.norm()) < 0.5, (i, fmt.kind)
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    # fp32: the same pages in another summation order (test_quant_targets.py's 1e-4); bf16 on a GPU: the bf16
    # targets' median bound (tests/test_targets.py)
    if DTYPE == torch.float32:
        assert err.max() < 1e-4, err
    else:
        assert err.median() < 0.25, err


def _ctx(preset: str, quant: str, kv: str) -> ModelingContext:
    return ModelingContext(config=contract.claimed_config(preset, {"quant": quant}, 2), arch="sm_90", quant="bf16",
                           kv_cache_dtype=kv)


@pytest.mark.parametrize("kv", ["fp8", "nvfp4", "bf16+fp8", "bf16+nvfp4", "fp8+nvfp4", "bf16+fp8+nvfp4"])
def test_router_picks_the_targets_for_quantized_pages(kv):
    for preset, quant, want in (("k3", "bf16", "kimi_k3_bf16__sm_90__default"),
                                ("k3", "mxfp4 experts", "kimi_k3_mxfp4__sm_90__default"),
                                ("kimi-linear-48b", "bf16", "kimi_linear_bf16__sm_90__default"),
                                ("kimi-linear-48b", "nvfp4 experts", "kimi_linear_nvfp4__sm_90__default")):
        assert route(_ctx(preset, quant, kv), "require")[0] == want, (preset, quant, kv)


def test_explain_shows_the_claimed_kv_dtypes_and_a_bf16_kda_state_is_declined():
    text = explain(_ctx("k3", "bf16", "bf16+fp8"))
    assert "ok   kv dtype: wanted ('bf16', 'fp8', 'nvfp4', 'bf16+fp8'" in text, text
    assert "decision: target kimi_k3_bf16__sm_90__default" in text
    for kv in ("bf16+kda-bf16", "fp8+kda-bf16", "fp16"):
        assert route(_ctx("k3", "bf16", kv), "auto")[0] is None, kv
        assert "MISS kv dtype" in explain(_ctx("k3", "bf16", kv))
