"""Targeted tests of the W4A16 kernels beyond the generic cell driver: every byte and scale code decodes bit for bit
(an identity activation makes the GEMM return the dequantized weight itself), the refusals of `is_valid`, and
proof that the comparison catches a kernel that reads the nibbles in the wrong order."""

import pytest
import torch

from kestrel.catalog._op import InvalidInput, validating
from kestrel.catalog.quant._common import MX_CODE_MAX
from kestrel.catalog.quant.w4a16_grouped_gemm import W4A16GroupedGemm
from kestrel.catalog.quant.w4a16_grouped_gemm_glu import W4A16GroupedGemmGlu
from kestrel.catalog.quant.w4a16_linear import W4A16Linear
from kestrel.quant.formats import dequantize_mx, dequantize_nvfp4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _identity(K):
    return torch.eye(K, dtype=torch.bfloat16, device=DEVICE)


def test_mxfp4_every_byte_and_scale_code_is_exact():
    """Rows hold all 256 bytes; block scale codes run over 132 exponents up to the largest accepted (2^-67 ..
    2^64). x = I_K, so y^T must be the reference dequantize bit for bit (one exact product per output, no sum)."""
    N, K = 66, 64
    packed = torch.arange(N * K // 2, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(N, K // 2)
    packed = packed[torch.randperm(N, generator=gen(1))]
    scale = (torch.arange(N * 2).reshape(N, 2) + 60).to(torch.uint8)
    assert int(scale.max()) == MX_CODE_MAX
    packed, scale = packed.to(DEVICE), scale.to(DEVICE)
    with validating(W4A16Linear):
        y = W4A16Linear.raw_call(_identity(K), packed, scale, out=torch.empty(K, N, device=DEVICE))
    ref = dequantize_mx(packed, scale)
    assert torch.equal(y.t().cpu(), ref.cpu())


@pytest.mark.parametrize("divisor", [True, False])
def test_nvfp4_every_byte_and_positive_e4m3_scale_is_exact(divisor):
    """All 256 bytes against all 126 positive finite e4m3 scale codes (subnormals included); the tensor scale 1
    (a divisor or a multiplier) keeps the products exact, so y^T equals the reference dequantize exactly."""
    N, K = 128, 32
    packed = torch.arange(N * K // 2, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(N, K // 2)
    codes = torch.arange(1, 127, dtype=torch.uint8)                       # 0x01..0x7E: every positive finite
    scale = codes.repeat(3)[:2 * N].reshape(N, 2).view(E4M3)
    second = torch.ones(N, 1)
    packed, scale, second = packed.to(DEVICE), scale.to(DEVICE), second.to(DEVICE)
    with validating(W4A16Linear):
        y = W4A16Linear.raw_call(_identity(K), packed, scale, second, divisor, out=torch.empty(K, N, device=DEVICE))
    assert torch.equal(y.t().cpu(), dequantize_nvfp4(packed, scale, second, divisor).cpu())


def test_swapped_nibbles_fail_the_comparison():
    """A kernel that read the high nibble first would answer a different GEMM: compare must refuse it."""
    cell = W4A16Linear.CELLS[0]
    inputs = W4A16Linear.make_inputs(cell.spec, DEVICE, gen(3))
    ref = W4A16Linear.reference(**inputs)
    p = inputs["packed"]
    swapped = dict(inputs, packed=((p >> 4) | (p << 4)).contiguous())
    with pytest.raises(AssertionError):
        W4A16Linear.compare(W4A16Linear.raw_call(**swapped), ref)
    W4A16Linear.compare(W4A16Linear.raw_call(**inputs), ref)


def test_grouped_matches_dense_per_expert():
    """Each expert's rows of the grouped GEMM equal the dense kernel on that expert's weight (same tiles, same
    order of summation within a row: bitwise)."""
    cell = W4A16GroupedGemm.CELLS[2]
    inputs = W4A16GroupedGemm.make_inputs(cell.spec, DEVICE, gen(4))
    y = W4A16GroupedGemm.raw_call(**inputs)
    offs = inputs["expert_offsets"].tolist()
    x = inputs["x"][inputs["sorted_token_ids"].long()]
    for e in range(len(offs) - 1):
        if offs[e + 1] == offs[e]:
            continue
        dense = W4A16Linear.raw_call(x[offs[e]:offs[e + 1]], inputs["packed"][e], inputs["scale"][e],
                                     inputs["second"][e], inputs["divisor"])
        assert torch.equal(y[offs[e]:offs[e + 1]], dense), e


def _dense_inputs(fmt="mxfp4"):
    return W4A16Linear.make_inputs(dict(M=2, K=64, N=32, fmt=fmt), DEVICE, gen(5))


@pytest.mark.parametrize("change,needle", [
    (lambda d: d.update(x=d["x"].half()), "bf16"),
    (lambda d: d.update(x=d["x"][:, :32]), "width"),
    (lambda d: d.update(scale=d["scale"][:, :1]), "scale must be"),
    (lambda d: d["scale"].__setitem__((0, 0), 255), "e8m0"),
    (lambda d: d.update(packed=d["packed"].to(torch.int8)), "uint8"),
    (lambda d: d.update(second=torch.ones(32, 1, device=DEVICE)), "no tensor scale"),
    (lambda d: d.update(out=d["x"][:, :32].clone().t()), "out must be"),
])
def test_mxfp4_refusals(change, needle):
    d = _dense_inputs()
    change(d)
    why = W4A16Linear.is_valid(**d)
    assert why and needle in why, why
    with validating(W4A16Linear), pytest.raises(InvalidInput):
        W4A16Linear.raw_call(**d)


@pytest.mark.parametrize("change,needle", [
    (lambda d: d.update(second=None), "needs second"),
    (lambda d: d.update(second=d["second"].reshape(1, 32)), "needs second"),
    (lambda d: d["second"].__setitem__((3, 0), 0.0), "zero or non-finite"),
    (lambda d: d.update(scale=d["scale"].float()), "scale must be"),
])
def test_nvfp4_refusals(change, needle):
    d = _dense_inputs("nvfp4")
    change(d)
    why = W4A16Linear.is_valid(**d)
    assert why and needle in why, why


def test_grouped_refusals():
    cell = W4A16GroupedGemm.CELLS[0]
    d = W4A16GroupedGemm.make_inputs(cell.spec, DEVICE, gen(6))
    assert W4A16GroupedGemm.is_valid(**d) is None
    bad = dict(d, expert_offsets=d["expert_offsets"].flip(0).contiguous())
    assert "expert_offsets" in W4A16GroupedGemm.is_valid(**bad)
    bad = dict(d, packed=d["packed"][0])
    assert "3 dims" in W4A16GroupedGemm.is_valid(**bad)
    bad = dict(d, out=d["x"].new_empty((d["sorted_token_ids"].numel(), 64), dtype=torch.float16))
    assert "out" in W4A16GroupedGemm.is_valid(**bad)


def _swap_halves(t):
    """w13's up rows first, then its gate rows (the [E, 2I, ...] halves exchanged)."""
    return torch.cat(t.chunk(2, dim=1)[::-1], dim=1).contiguous()


@pytest.mark.parametrize("cell", [0, 1])
def test_glu_equals_the_separate_gemm_then_glu(cell):
    """The fused entry answers what it replaces in W4A16Experts: W4A16GroupedGemm over w13, then SiluGlu / SituGlu;
    and a kernel that paired up row j with gate row j the other way round (gate and up exchanged) is refused."""
    from kestrel.catalog.moe.glu import SiluGlu, SituGlu
    cell = W4A16GroupedGemmGlu.CELLS[cell]
    d = W4A16GroupedGemmGlu.make_inputs(cell.spec, DEVICE, gen(11))
    with validating(W4A16GroupedGemmGlu):
        h = W4A16GroupedGemmGlu.raw_call(**d)
    w13 = {k: d[k] for k in ("packed", "scale", "second", "divisor") if k in d}
    gu = W4A16GroupedGemm.raw_call(d["x"], expert_offsets=d["expert_offsets"],
                                   sorted_token_ids=d["sorted_token_ids"], **w13)
    two = SiluGlu.raw_call(gu) if d["act"] == "silu" else SituGlu.raw_call(gu, d["beta"], d["linear_beta"])
    W4A16GroupedGemmGlu.compare(h, two)
    swapped = dict(d, packed=_swap_halves(d["packed"]), scale=_swap_halves(d["scale"]),
                   **({"second": _swap_halves(d["second"])} if "second" in d else {}))
    with pytest.raises(AssertionError):
        W4A16GroupedGemmGlu.compare(W4A16GroupedGemmGlu.raw_call(**swapped), W4A16GroupedGemmGlu.reference(**d))


def test_glu_refusals():
    cell = W4A16GroupedGemmGlu.CELLS[1]
    d = W4A16GroupedGemmGlu.make_inputs(cell.spec, DEVICE, gen(12))
    assert W4A16GroupedGemmGlu.is_valid(**d) is None
    S, I = d["sorted_token_ids"].numel(), d["packed"].shape[1] // 2
    for bad, needle in [
        (dict(d, sorted_token_ids=None), "sorted_token_ids is required"),
        (dict(d, x=d["x"].float()), "bf16"),
        (dict(d, second=None), "needs second"),
        (dict(d, packed=d["packed"][:, :-1], scale=d["scale"][:, :-1], second=d["second"][:, :-1]), "even"),
        (dict(d, act="gelu"), "act"),
        (dict(d, beta=0.0), "betas"),
        (dict(d, out=torch.empty((S, I), dtype=torch.float32, device=DEVICE)), "out must be"),
        (dict(d, out=torch.empty((S, 2 * I), dtype=torch.bfloat16, device=DEVICE)), "out must be"),
        (dict(d, out=d["x"].view(-1)[:S * I].view(S, I)), "overlaps"),
        (dict(d, expert_offsets=d["expert_offsets"].flip(0).contiguous()), "expert_offsets"),
    ]:
        why = W4A16GroupedGemmGlu.is_valid(**bad)
        assert why and needle in why, (needle, why)
    with validating(W4A16GroupedGemmGlu), pytest.raises(InvalidInput):
        W4A16GroupedGemmGlu.raw_call(**dict(d, act="gelu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("entry", [W4A16GroupedGemm, W4A16GroupedGemmGlu])
def test_grouped_decode_captures_in_a_cuda_graph(entry):
    """Decode runs inside the fast path's CUDA graphs: capture once, change the routing in place, replay."""
    cell = next(c for c in entry.CELLS if "K3 latent MoE mxfp4 decode bs8: w13" in c.why)
    d = entry.make_inputs(cell.spec, DEVICE, gen(7))
    out = entry.raw_call(**d).clone()
    d["out"] = out
    entry.raw_call(**d)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        entry.raw_call(**d)
    fresh = entry.make_inputs(cell.spec, DEVICE, gen(8))
    for name in ("x", "expert_offsets", "sorted_token_ids"):
        d[name].copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    entry.compare(out, entry.reference(**dict(d, out=None)))


def test_launch_widths_match_the_cell_widths():
    """widths() of a cell's own inputs equals cell_widths(spec): a target's launch at a cell's widths is matched."""
    from kestrel.catalog.quant.fp8_linear import Fp8Linear
    from kestrel.catalog.quant.fp8_quant_rows import Fp8QuantRows
    for entry in (W4A16Linear, W4A16GroupedGemm, W4A16GroupedGemmGlu, Fp8Linear, Fp8QuantRows):
        for cell in entry.CELLS:
            if "cpu" not in cell.archs:
                continue
            inputs = entry.make_inputs(cell.spec, DEVICE, gen(10))
            assert entry.widths(**inputs) == entry.cell_widths(cell.spec), (entry.name(), cell.why)
