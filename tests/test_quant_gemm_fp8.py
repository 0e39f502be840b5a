"""Targeted tests of the W8A8 FP8 kernels beyond the generic cell driver: activation rounding ties and zero rows
bit for bit, every e4m3 weight code through an identity GEMM in each scale form, split K, the refusals, and proof
that the comparison catches a kernel that read the wrong K block's scale."""

import pytest
import torch

from kestrel.catalog._op import InvalidInput, validating
from kestrel.catalog.quant.fp8_linear import Fp8Linear, dequantize_weight
from kestrel.catalog.quant.fp8_quant_rows import Fp8QuantRows, quantize_rows_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _all_finite_e4m3():
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F]                       # drop the two NaN codes
    return codes.to(torch.uint8).view(E4M3)


def test_quant_rows_ties_saturation_and_zero_rows():
    """Row 0 has amax 448 (scale 1) and every midpoint between neighbouring e4m3 values, so each element is a
    tie that must go to the even code; row 1 is all zeros (scale 1, codes 0); row 2 is every finite e4m3 value
    times 3 (exact after scaling back)."""
    vals = _all_finite_e4m3().float()
    pos = vals[vals >= 0].unique().sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    row0 = torch.cat([mids, -mids, torch.tensor([448.0])])
    K = 512
    x = torch.zeros(3, K)
    x[0, :row0.numel()] = row0
    x[0, row0.numel()] = -0.0                                      # keeps its sign: code 0x80
    x[2, :vals.numel()] = vals * 3
    x = x.to(DEVICE)
    with validating(Fp8QuantRows):
        q, s = Fp8QuantRows.raw_call(x)
    Fp8QuantRows.compare((q, s), quantize_rows_reference(x))
    assert s.cpu().flatten().tolist() == [1.0, 1.0, 3.0]
    # ties to even: 1.0625 (between 1.0 and 1.125) -> 1.0, 1.1875 (between 1.125 and 1.25) -> 1.25
    got = dict(zip(row0.tolist(), q[0, :row0.numel()].float().cpu().tolist()))
    assert got[1.0625] == 1.0 and got[1.1875] == 1.25 and got[-1.0625] == -1.0
    assert (q[1].view(torch.uint8) == 0).all() and int(q[0, row0.numel()].view(torch.uint8)) == 0x80
    torch.testing.assert_close(q[2, :vals.numel()].float().cpu(), vals, rtol=0, atol=0)


def test_quant_rows_catches_a_wrong_code():
    x = torch.randn(4, 64, generator=gen(1)).to(DEVICE)
    q, s = Fp8QuantRows.raw_call(x)
    bad = q.view(torch.uint8).clone()
    bad[2, 5] ^= 1
    with pytest.raises(AssertionError):
        Fp8QuantRows.compare((bad.view(E4M3), s), quantize_rows_reference(x))


def _identity_inputs(granularity, K=256):
    """xq = I_K (scale 1): y^T is the dequantized weight itself, one product per output (exact in fp32)."""
    codes = _all_finite_e4m3()
    N = codes.numel() * K // K                                     # 254 rows, every code in each column set
    weight = codes.view(torch.uint8).repeat(K)[:N * K].reshape(N, K)
    weight = weight[:, torch.randperm(K, generator=gen(2))].contiguous().view(E4M3)
    if granularity == "mx":
        scale = (torch.arange(N * K // 32) % 40 + 100).to(torch.uint8).reshape(N, K // 32)
    elif granularity == "block":
        scale = torch.tensor([[2.0 ** -3, 0.75]]).repeat_interleave(N, 0)
    else:
        scale = torch.linspace(0.5, 3.0, N).reshape(N, 1)
    xq = torch.eye(K).to(E4M3)
    return dict(xq=xq.to(DEVICE), x_scale=torch.ones(K, 1, device=DEVICE), weight=weight.to(DEVICE),
                weight_scale=scale.contiguous().to(DEVICE), out=torch.empty(K, N, device=DEVICE))


@pytest.mark.parametrize("granularity", ["channel", "block", "mx"])
def test_every_weight_code_is_exact(granularity):
    d = _identity_inputs(granularity)
    with validating(Fp8Linear):
        y = Fp8Linear.raw_call(**d)
    assert torch.equal(y.t().cpu(), dequantize_weight(d["weight"], d["weight_scale"]).cpu())


def test_wrong_block_scale_fails_the_comparison():
    """A kernel that used the next K block's scale answers a different GEMM: compare must refuse it."""
    cell = next(c for c in Fp8Linear.CELLS if c.spec.get("granularity") == "block" and "block scales" in c.why)
    d = Fp8Linear.make_inputs(cell.spec, DEVICE, gen(3))
    ref = Fp8Linear.reference(**d)
    shifted = dict(d, weight_scale=d["weight_scale"].roll(1, dims=1).contiguous())
    with pytest.raises(AssertionError):
        Fp8Linear.compare(Fp8Linear.raw_call(**shifted), ref)
    Fp8Linear.compare(Fp8Linear.raw_call(**d), ref)


@pytest.mark.parametrize("granularity", ["channel", "mx"])
def test_split_k_matches_one_pass(granularity):
    spec = dict(M=3, K=256, N=40, granularity=granularity, out_dtype=torch.float32)
    d = Fp8Linear.make_inputs(spec, DEVICE, gen(4))
    one = Fp8Linear.raw_call(**dict(d, out=torch.empty_like(d["out"]), split_k=1))
    four = Fp8Linear.raw_call(**dict(d, out=torch.empty_like(d["out"]), split_k=4))
    torch.testing.assert_close(four, one, rtol=1e-5, atol=1e-5)
    Fp8Linear.compare(four, Fp8Linear.reference(**d))


def _linear_inputs(granularity="block"):
    return Fp8Linear.make_inputs(dict(M=2, K=256, N=64, granularity=granularity), DEVICE, gen(5))


@pytest.mark.parametrize("change,needle", [
    (lambda d: d.update(xq=d["xq"].float()), "xq must be"),
    (lambda d: d.update(x_scale=d["x_scale"].reshape(-1)), "x_scale"),
    (lambda d: d.update(weight=d["weight"][:, :128]), "weight must be"),
    (lambda d: d.update(weight_scale=d["weight_scale"][:, :1].contiguous().half()), "weight_scale must be fp32"),
    (lambda d: d.update(weight_scale=d["weight_scale"][:48]), "weight_scale must be"),
    (lambda d: d.update(out=torch.empty(2, 64, dtype=torch.float16, device=DEVICE)), "out must be"),
    (lambda d: d.update(split_k=0), "split_k"),
])
def test_fp8_linear_refusals(change, needle):
    d = _linear_inputs()
    assert Fp8Linear.is_valid(**d) is None
    change(d)
    why = Fp8Linear.is_valid(**d)
    assert why and needle in why, why
    with validating(Fp8Linear), pytest.raises(InvalidInput):
        Fp8Linear.raw_call(**d)


def test_mxfp8_nan_scale_is_refused():
    d = _linear_inputs("mx")
    d["weight_scale"][1, 2] = 0xFF
    assert "NaN" in Fp8Linear.is_valid(**d)


def test_quant_rows_refusals():
    x = torch.randn(3, 64, device=DEVICE)
    assert "int" not in (Fp8QuantRows.is_valid(x) or "")
    assert "must be bf16" in Fp8QuantRows.is_valid(x.to(torch.int32))
    assert "out must be" in Fp8QuantRows.is_valid(x, out=torch.empty(3, 64, device=DEVICE))
    assert "overlap" in Fp8QuantRows.is_valid(x, scale_out=x.view(-1)[:3].reshape(3, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_quantize_and_gemm_capture_in_a_cuda_graph():
    """Activation quantization then the split-K GEMM (a K3 decode shape), captured once and replayed on new x."""
    K, N = 7168, 1536
    d = Fp8Linear.make_inputs(dict(M=4, K=K, N=N, granularity="block"), DEVICE, gen(9))
    x = torch.randn(4, K, device=DEVICE).bfloat16()
    q, s = torch.empty_like(d["xq"]), torch.empty_like(d["x_scale"])
    out = torch.empty(4, N, dtype=torch.bfloat16, device=DEVICE)

    def step():
        Fp8QuantRows.raw_call(x, q, s)
        Fp8Linear.raw_call(q, s, d["weight"], d["weight_scale"], out=out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(torch.randn(4, K, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    rq, rs = quantize_rows_reference(x)
    Fp8QuantRows.compare((q, s), (rq, rs))
    Fp8Linear.compare(out, Fp8Linear.reference(rq, rs, d["weight"], d["weight_scale"]))
