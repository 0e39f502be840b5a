"""Element codes and weight formats against independent computations: bit-field decodes of every e2m1 / e4m3 /
e8m0 code, a brute-force nearest-even rounding over each format's value table, per-block scales computed in Python
floats, and compressed-tensors' own packers on the same inputs."""

from __future__ import annotations

import math

import pytest
import torch

from kestrel.quant.codes import (e2m1_decode, e2m1_encode, e4m3_encode, e8m0_decode, e8m0_encode, mx_scale_exponent,
                                 pack_nibbles, unpack_nibbles)
from kestrel.quant.formats import (dequantize_fp8, dequantize_mx, dequantize_nvfp4, fp8_scale_shape, quantize_fp8,
                                   quantize_mx, quantize_nvfp4)


# ---------------------------------------------------------------------------------------------------------------
# independent definitions (bit fields, brute force)

def e2m1_value(code: int) -> float:
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


def e4m3_value(code: int) -> float:
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return math.nan
    mag = 2.0 ** -6 * m / 8 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
    return -mag if s else mag


E2M1_CODES = [(c, e2m1_value(c)) for c in range(8)]
E4M3_CODES = [(c, e4m3_value(c)) for c in range(127)]        # the finite non-negative codes


def nearest_even(x: float, table: list[tuple[int, float]], top: float) -> int:
    """Round |x| to the table by brute force: the nearest value; on a tie the even code; beyond `top` saturate."""
    a = min(abs(x), top)
    best = min(table, key=lambda cv: (abs(a - cv[1]), cv[0] % 2))
    return best[0]


def rne_e2m1(x: float) -> int:
    return nearest_even(x, E2M1_CODES, 6.0) | (8 if math.copysign(1, x) < 0 else 0)


def rne_e4m3(x: float) -> float:
    if math.isnan(x):
        return math.nan
    v = e4m3_value(nearest_even(x, E4M3_CODES, 448.0))
    return -v if x < 0 else v


def rand(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------------------------------------------
# codes

def test_e2m1_every_code_point():
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_decode(codes).tolist() == [e2m1_value(c) for c in range(16)]
    values = torch.tensor([e2m1_value(c) for c in range(16)])
    values[8] = -0.0
    assert e2m1_encode(values).tolist() == list(range(16))


def test_e2m1_ties_round_to_even_and_saturate():
    mags = [v for _, v in E2M1_CODES]
    mids = [(a + b) / 2 for a, b in zip(mags, mags[1:])]
    probes = mids + [m + d for m in mids for d in (-1e-3, 1e-3)] + [6.0, 6.5, 7.0, 1e30, float("inf")]
    x = torch.tensor(probes + [-p for p in probes], dtype=torch.float32)
    assert e2m1_encode(x).tolist() == [rne_e2m1(v) for v in x.tolist()]
    # the tie rule by hand: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0
    assert e2m1_decode(e2m1_encode(torch.tensor(mids))).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    dense = torch.linspace(-8, 8, 4001)
    assert e2m1_encode(dense).tolist() == [rne_e2m1(v) for v in dense.tolist()]


def test_pack_then_unpack_is_exact_low_nibble_first():
    codes = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (5, 32)
    assert torch.equal(packed[:, 3], codes[:, 6] | (codes[:, 7] << 4))
    assert torch.equal(unpack_nibbles(packed), codes)
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    assert torch.equal(pack_nibbles(unpack_nibbles(every_byte)), every_byte)
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(codes[:, :7])


def test_nibble_order_matches_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    values = e2m1_decode(torch.randint(0, 16, (4, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8))
    ours = pack_nibbles(e2m1_encode(values))
    assert torch.equal(pack_fp4_to_uint8(values), ours)
    assert torch.equal(unpack_fp4_from_uint8(ours, 4, 32, torch.float32), e2m1_decode(unpack_nibbles(ours)))


def test_e4m3_every_code_point_ties_and_saturation():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = codes.view(torch.float8_e4m3fn).float()
    want = torch.tensor([e4m3_value(c) for c in range(256)])
    assert torch.equal(decoded.isnan(), want.isnan()) and want.isnan().sum() == 2
    ok = ~want.isnan()
    assert torch.equal(decoded[ok], want[ok])
    # every finite code encodes back to itself (-0.0 included)
    assert torch.equal(e4m3_encode(decoded[ok]).view(torch.uint8), codes[ok])
    finite = sorted({v for _, v in E4M3_CODES})
    mids = [(a + b) / 2 for a, b in zip(finite, finite[1:])]
    probes = mids + [m * (1 + s * 1e-6) for m in mids for s in (-1, 1)] + [448.0, 449.0, 464.0, 480.0, 1e6,
                                                                           float("inf"), float("nan")]
    x = torch.tensor(probes + [-p for p in probes], dtype=torch.float64)
    got = e4m3_encode(x).float().tolist()
    want = [rne_e4m3(v) for v in x.tolist()]
    assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, want))


def test_e8m0_every_code_point():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = e8m0_decode(codes)
    assert got[255].isnan()
    assert got[:255].tolist() == [math.ldexp(1.0, c - 127) for c in range(255)]
    assert torch.equal(e8m0_decode(codes.view(torch.float8_e8m0fnu))[:255], got[:255])
    assert torch.equal(codes.view(torch.float8_e8m0fnu).float()[:255], got[:255])   # torch's own reading
    exps = torch.arange(-127, 128, dtype=torch.float32)
    assert torch.equal(e8m0_encode(exps), codes[:255])
    assert e8m0_encode(torch.tensor([float("nan"), -500.0, 500.0])).tolist() == [255, 0, 254]


def test_mx_scale_rules_and_compressed_tensors_convention():
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
    amax = torch.cat([rand(2000, 2).abs() * 10.0 ** torch.randint(-6, 6, (2000,),
                                                                  generator=torch.Generator().manual_seed(3)),
                      torch.tensor([1.0, 1.5, 1.75, 1.7499, 2.0, 6.0, 7.0, 448.0, 500.0, 2.0 ** -130])])
    for emax in (2, 8):
        ocp = mx_scale_exponent(amax, emax, "ocp")
        assert ocp.tolist() == [float(math.frexp(a)[1] - 1 - emax) for a in amax.tolist()]
        up = mx_scale_exponent(amax, emax, "round-up")
        bump = [float(math.frexp(a)[0] >= 0.875) for a in amax.tolist()]
        assert torch.equal(up, ocp + torch.tensor(bump))
        # compressed-tensors' MXFP4 / MXFP8 scale selection is the round-up rule (its exponent is biased by 127);
        # its bit trick sends a subnormal amax (the last probe) to -inf, so that one is left out
        ct = generate_mx_scales(amax[:-1], num_bits=4 if emax == 2 else 8)
        assert torch.equal(ct, up[:-1] + 127)
        # ModelOpt's MXFP4: the smallest exponent that does not saturate
        top = 6.0 if emax == 2 else 448.0
        ceil = mx_scale_exponent(amax, emax, "ceil")
        assert ceil[:-1].tolist() == [float(math.ceil(math.log2(a / top))) for a in amax[:-1].tolist()]
        assert ((amax / torch.exp2(ceil) <= top) | (amax == 0)).all()
    special = mx_scale_exponent(torch.tensor([0.0, float("nan"), float("inf")]), 2)
    assert special[0] == -127 and special[1:].isnan().all()


# ---------------------------------------------------------------------------------------------------------------
# formats

def blocky(n, k, block, seed):
    """Random weights whose blocks differ in magnitude by powers of 8, so a wrong block boundary shows."""
    w = rand((n, k), seed)
    mag = 8.0 ** torch.randint(-3, 4, (n, k // block), generator=torch.Generator().manual_seed(seed + 1))
    return w * mag.repeat_interleave(block, -1)


@pytest.mark.parametrize("elem", ["e2m1", "e4m3"])
def test_mx_against_per_block_python(elem):
    w = blocky(3, 96, 32, seed=4)
    values, scale = quantize_mx(w, elem)
    deq = dequantize_mx(values, scale)
    emax = 2 if elem == "e2m1" else 8
    for r in range(3):
        for b in range(3):
            blk = w[r, 32 * b:32 * (b + 1)].tolist()
            e = math.frexp(max(abs(v) for v in blk))[1] - 1 - emax
            assert scale[r, b].item() == e + 127
            s = 2.0 ** e
            for j, v in enumerate(blk):
                q = e2m1_value(rne_e2m1(v / s)) if elem == "e2m1" else rne_e4m3(v / s)
                assert deq[r, 32 * b + j].item() == q * s
    # a representable weight re-quantizes to itself: quantize o dequantize is the identity on stored codes
    v2, s2 = quantize_mx(deq, elem)
    assert torch.equal(s2, scale) and torch.equal(v2.view(torch.uint8), values.view(torch.uint8))


def test_mxfp4_matches_compressed_tensors_packer():
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    w = blocky(4, 64, 32, seed=5)
    packed, scale = quantize_mx(w, "e2m1")
    theirs = quantize_and_pack_fp4(w, e8m0_decode(scale), group_size=32)
    assert torch.equal(theirs, packed)


def nvfp4_python(w: torch.Tensor):
    """compressed-tensors' NVFP4 recipe in Python floats: g = 448*6/amax, s = e4m3(amax_b/6 * g), q = e2m1(x/(s/g))."""
    rows = w.tolist()
    amax = max(abs(v) for r in rows for v in r)
    g = torch.tensor(448.0 * 6.0 / amax, dtype=torch.float32).item()
    out = []
    for r in rows:
        line = []
        for b in range(0, len(r), 16):
            blk = r[b:b + 16]
            s = rne_e4m3(torch.tensor(max(abs(v) for v in blk) / 6.0, dtype=torch.float32).item() * g)
            eff = torch.tensor(s, dtype=torch.float32) / torch.tensor(g, dtype=torch.float32)
            line += [e2m1_value(rne_e2m1((torch.tensor(v) / eff).item())) * eff.item() for v in blk]
        out.append(line)
    return torch.tensor(out), g


def test_nvfp4_against_python_and_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    w = blocky(3, 64, 16, seed=6) * 0.01
    packed, scale, g = quantize_nvfp4(w)
    deq = dequantize_nvfp4(packed, scale, g)
    want, g_py = nvfp4_python(w)
    assert g.item() == g_py
    assert torch.equal(deq, want)
    assert torch.equal(quantize_and_pack_fp4(w, scale.float(), global_scale=g, group_size=16), packed)
    # ModelOpt's spelling of the same format: scale_2 = amax/(448*6), a multiplier
    p2, s2, m = quantize_nvfp4(w, "modelopt")
    assert m.item() == pytest.approx(1 / g.item(), rel=1e-6)
    d2 = dequantize_nvfp4(p2, s2, m, divisor=False)
    # the largest e2m1 step is 2 (from 4 to 6), so no element is off by more than its block's scale
    for d, eff in ((d2, s2.float() * m), (deq, scale.float() / g)):
        assert ((d - w).abs() <= eff.repeat_interleave(16, -1) * (1 + 1e-6)).all()


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_against_python(granularity):
    n, k = (130, 200) if granularity == "block" else (5, 48)       # partial edge blocks
    w = rand((n, k), 7) * torch.linspace(0.01, 100, n).unsqueeze(1)
    q, s = quantize_fp8(w, granularity)
    assert tuple(s.shape) == fp8_scale_shape(n, k, granularity)
    deq = dequantize_fp8(q, s, granularity)
    rows = w.tolist()
    def amax_of(r, c):
        if granularity == "tensor":
            return w.abs().max().item()
        if granularity == "channel":
            return max(abs(v) for v in rows[r])
        return w[r // 128 * 128:(r // 128 + 1) * 128, c // 128 * 128:(c // 128 + 1) * 128].abs().max().item()
    for r, c in [(0, 0), (n - 1, k - 1), (n // 2, k // 3), (min(129, n - 1), min(199, k - 1)), (1, k - 1)]:
        scale = torch.tensor(amax_of(r, c), dtype=torch.float32) / 448.0
        want = rne_e4m3((torch.tensor(rows[r][c]) / scale).item()) * scale.item()
        assert deq[r, c].item() == pytest.approx(want, rel=1e-7)
    assert ((deq - w).abs() <= w.abs() * 2.0 ** -4 + 1e-30 + (2.0 ** -9) * s.max()).all()


def test_odd_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mx(rand((4, 48), 0), "e2m1")
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(rand((4, 40), 0))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_fp8(rand((4,), 0))


def test_nan_and_inf():
    w = rand((2, 64), 8)
    w[0, 3] = float("nan")
    w[1, 40] = float("inf")
    for elem in ("e2m1", "e4m3"):
        values, scale = quantize_mx(w, elem)
        deq = dequantize_mx(values, scale)
        assert deq[0, :32].isnan().all() and deq[1, 32:].isnan().all()          # the block is marked by its scale
        assert torch.isfinite(deq[0, 32:]).all() and torch.isfinite(deq[1, :32]).all()
    w16 = torch.cat([w, rand((2, 0), 0)], 1)
    packed, scale, g = quantize_nvfp4(w16)
    deq = dequantize_nvfp4(packed, scale, g)
    assert deq[0, :16].isnan().all() and deq[1, 32:48].isnan().all()
    assert torch.isfinite(g) and torch.isfinite(deq[0, 16:]).all()
    q, s = quantize_fp8(w, "tensor")
    d = dequantize_fp8(q, s, "tensor")
    assert d[0, 3].isnan() and d[1, 40] == 448.0 * s.item() and torch.isfinite(s).all()
    assert d.isnan().sum() == 1
