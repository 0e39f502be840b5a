"""The W4A16 decode kernels (kestrel/kernels/quant/w4a16_gemv.py: fp32 FMA over packed words, 1, 2 or 4 rows per
program; w4a16_tc.py: tensor cores over a register dequantize, 16-row tiles) against the plain-torch reference:
every byte and scale code bit for bit, fresh random weights and activations with 0..8 (and 17) rows per expert (untouched experts, experts spanning several tiles), MXFP4 and both NVFP4
tensor-scale conventions, with and without the fused GLU, K split; and the host's choice of path per shape."""

import struct

import pytest
import torch

from kestrel.catalog.moe.permute import permute_reference
from kestrel.catalog.quant._common import random_fp4_weight
from kestrel.catalog.quant.w4a16_grouped_gemm import K3_MOE, KL_MOE, W4A16GroupedGemm
from kestrel.catalog.quant.w4a16_grouped_gemm_glu import W4A16GroupedGemmGlu
from kestrel.catalog.quant.w4a16_linear import W4A16Linear
from kestrel.kernels.quant import w4a16
from kestrel.kernels.quant.w4a16 import w4a16_config, w4a16_gemm
from kestrel.kernels.quant.w4a16_glu import w4a16_glu_config, w4a16_glu_gemm
from kestrel.kernels.quant.w4a16_gemv import decode_rows, decode_tiles
from kestrel.quant.formats import dequantize_mx, dequantize_nvfp4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn
COUNTS = [0, 1, 2, 3, 4, 5, 8, 0, 1, 17]      # rows per expert: untouched ones, ones past 4 and past 16 rows


def gen(seed):
    return torch.Generator().manual_seed(seed)


def _routing(counts, T, g):
    """expert_offsets for `counts` rows per expert and random token ids in [0, T) (each token at most once per
    expert, as top-k routing gives)."""
    offs = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
    ids = torch.cat([torch.randperm(T, generator=g)[:c] for c in counts]).to(torch.int32)
    return offs.to(DEVICE), ids.to(DEVICE)


def _weights(fmt, E, N, K, g):
    divisor = fmt != "nvfp4 modelopt"
    w = random_fp4_weight(fmt.split()[0], (E,), N, K, g, DEVICE, divisor)
    return {"second": None, "divisor": True, **w}


@pytest.mark.parametrize("fmt,rows,gather,N,K,BN,BK,split", [
    ("mxfp4", 1, True, 128, 256, 128, 256, 1),
    ("mxfp4", 2, False, 192, 512, 128, 128, 1),     # a partial N tile
    ("mxfp4", 4, True, 128, 256, 64, 128, 1),
    ("nvfp4", 1, False, 128, 256, 128, 256, 1),
    ("nvfp4", 2, True, 128, 256, 64, 128, 1),
    ("nvfp4 modelopt", 4, False, 256, 512, 256, 256, 1),
    ("mxfp4", 16, True, 128, 256, 64, 128, 1),      # the tensor-core decode kernel
    ("mxfp4", 16, False, 192, 512, 128, 256, 2),    # a partial N tile; K split in 2
    ("nvfp4", 16, True, 128, 256, 128, 256, 1),
    ("nvfp4 modelopt", 16, False, 64, 256, 64, 128, 1),
])
def test_grouped_decode_matches_reference(fmt, rows, gather, N, K, BN, BK, split):
    g = gen(rows * 7 + len(fmt) + N + split)
    E, T = len(COUNTS), 20
    offs, ids = _routing(COUNTS, T, g)
    S = int(offs[-1])
    w = _weights(fmt, E, N, K, g)
    x = torch.randn((T if gather else S, K), generator=g).to(torch.bfloat16).to(DEVICE)
    y = w4a16_gemm(x, w["packed"], w["scale"], w["second"], w["divisor"], offs, ids if gather else None,
                   split_k=split, config=(rows, BN, BK, 4, 1))
    ref = W4A16GroupedGemm.reference(x, w["packed"], w["scale"], offs, w["second"], w["divisor"],
                                     ids if gather else None)
    W4A16GroupedGemm.compare(y, ref)


@pytest.mark.parametrize("fmt,rows,act,I,K,BN,BK", [
    ("mxfp4", 2, "silu", 64, 256, 64, 128),
    ("nvfp4", 4, "situ", 128, 256, 64, 256),
    ("nvfp4 modelopt", 1, "silu", 96, 512, 64, 256),     # a partial intermediate tile
    ("mxfp4", 16, "situ", 64, 256, 64, 256),             # the tensor-core decode kernel
    ("nvfp4", 16, "silu", 96, 256, 64, 128),
    ("nvfp4 modelopt", 16, "situ", 64, 512, 32, 256),
])
def test_grouped_glu_decode_matches_reference(fmt, rows, act, I, K, BN, BK):
    g = gen(rows * 11 + len(act) + I)
    E, T = len(COUNTS), 20
    offs, ids = _routing(COUNTS, T, g)
    w = _weights(fmt, E, 2 * I, K, g)
    x = torch.randn((T, K), generator=g).to(torch.bfloat16).to(DEVICE)
    h = w4a16_glu_gemm(x, w["packed"], w["scale"], w["second"], w["divisor"], offs, ids, act,
                       config=(rows, BN, BK, 4, 1))
    ref = W4A16GroupedGemmGlu.reference(x, w["packed"], w["scale"], offs, ids, w["second"], w["divisor"], act)
    W4A16GroupedGemmGlu.compare(h, ref)


@pytest.mark.parametrize("fmt,rows,split", [("mxfp4", 4, 2), ("nvfp4", 1, 4), ("nvfp4", 16, 4)])
def test_dense_decode_split_k_matches_reference(fmt, rows, split):
    g = gen(rows + split)
    N, K, M = 96, 512, 3
    w = random_fp4_weight(fmt, (), N, K, g, DEVICE)
    x = torch.randn((M, K), generator=g).to(torch.bfloat16).to(DEVICE)
    y = w4a16_gemm(x, w["packed"], w["scale"], w.get("second"), split_k=split, config=(rows, 32, 64, 4, 1))
    W4A16Linear.compare(y, W4A16Linear.reference(x, w["packed"], w["scale"], w.get("second")))


def _every_byte_in_every_word_position(N, K):
    """Byte (n, j) = (n * (K/2 + 1) + j) mod 256: every value, and each at all four byte positions of a word."""
    n = torch.arange(N)[:, None]
    j = torch.arange(K // 2)[None, :]
    return ((n * (K // 2 + 1) + j) % 256).to(torch.uint8).to(DEVICE)


def _one_hot_rows(K):
    return torch.eye(K, dtype=torch.bfloat16, device=DEVICE)


@pytest.mark.parametrize("config", [(4, 128, 64, 4, 1), (16, 64, 64, 4, 1)], ids=["gemv", "tc"])
def test_decode_mxfp4_every_byte_and_scale_code_is_exact(config):
    """All 256 bytes in every nibble position of a word, scale codes 58..191 (134 exponents; the tensor-core
    kernel's exact range, 58..64 making bf16 subnormal weights there, 191 the largest accepted code): one-hot
    activation rows make each output a single product, so y^T equals the reference dequantize bit for bit."""
    N, K = 67, 64
    packed = _every_byte_in_every_word_position(N, K)
    scale = (torch.arange(N * 2).reshape(N, 2) + 58).to(torch.uint8).to(DEVICE)
    assert int(scale.max()) == 191
    y = w4a16_gemm(_one_hot_rows(K), packed, scale, out=torch.empty(K, N, device=DEVICE), config=config)
    assert torch.equal(y.t().cpu(), dequantize_mx(packed, scale).cpu())


@pytest.mark.parametrize("config", [(2, 64, 32, 4, 1), (16, 128, 32, 4, 1)], ids=["gemv", "tc"])
@pytest.mark.parametrize("divisor", [True, False])
def test_decode_nvfp4_every_byte_and_positive_e4m3_scale_is_exact(divisor, config):
    """All 256 bytes against every positive finite e4m3 scale (subnormals and 448, the saturated one, included)."""
    N, K = 128, 32
    packed = _every_byte_in_every_word_position(N, K)
    scale = torch.arange(1, 127, dtype=torch.uint8).repeat(3)[:2 * N].reshape(N, 2).view(E4M3).to(DEVICE)
    second = torch.ones(N, 1, device=DEVICE)
    y = w4a16_gemm(_one_hot_rows(K), packed, scale, second, divisor, out=torch.empty(K, N, device=DEVICE),
                   config=config)
    assert torch.equal(y.t().cpu(), dequantize_nvfp4(packed, scale, second, divisor).cpu())


@pytest.mark.parametrize("config", [(2, 32, 128, 4, 1), (16, 64, 128, 4, 1)], ids=["gemv", "tc"])
def test_decode_swapped_nibbles_fail_the_comparison(config):
    """A decode that read the high nibble first (the tensor-core kernel: swapped the low / high tiles or the even /
    odd columns) would answer a different GEMM: compare must refuse it."""
    g = gen(5)
    N, K = 64, 128
    w = random_fp4_weight("mxfp4", (), N, K, g, DEVICE)
    x = torch.randn((2, K), generator=g).to(torch.bfloat16).to(DEVICE)
    ref = W4A16Linear.reference(x, w["packed"], w["scale"])
    p = w["packed"]
    swapped = ((p >> 4) | (p << 4)).contiguous()
    with pytest.raises(AssertionError):
        W4A16Linear.compare(w4a16_gemm(x, swapped, w["scale"], config=config), ref)
    W4A16Linear.compare(w4a16_gemm(x, p, w["scale"], config=config), ref)


def test_real_width_kimi_linear_w2_decode():
    """Kimi Linear's w2 at its real widths (N = hidden 2304, K = moe_intermediate 1024), one decode token over
    its experts (a stack of 8 here), MXFP4, with the GPU's K step and 256-row tiles (few interpreted programs)."""
    g = gen(9)
    E, k, N, K = 8, 2, KL_MOE[4], KL_MOE[3] // 2
    perm = permute_reference(torch.tensor([[1, 6]], device=DEVICE), E)
    w = random_fp4_weight("mxfp4", (E,), N, K, g, DEVICE)
    x = torch.randn((k, K), generator=g).to(torch.bfloat16).to(DEVICE)
    y = w4a16_gemm(x, w["packed"], w["scale"], expert_offsets=perm.expert_offsets, config=(1, 256, 256, 4, 1))
    W4A16GroupedGemm.compare(y, W4A16GroupedGemm.reference(x, w["packed"], w["scale"], perm.expert_offsets))


def test_host_picks_the_decode_path_by_rows_per_expert(monkeypatch):
    """The configs the GPU runs: by default (path "auto") the FMA kernel (BM 1) at one row per touched expert
    (batch 1 and 8 of both models), from two (batch 64) the split (the tensor-core decode kernel's config, BM 16,
    with the FMA kernel over the one-row experts) and past 3 the tensor-core kernel alone; path="tc" / "gemv"
    force either (the FMA kernels take 1, 2 or 4 rows per program while the rows per expert are that few); the
    64 / 128-row tiles past 16 rows per expert and for prefill."""
    monkeypatch.setattr(w4a16, "interpreting", lambda: False)
    from kestrel.kernels.quant import w4a16_glu
    monkeypatch.setattr(w4a16_glu, "interpreting", lambda: False)
    for _, E, k, n13, hidden in (K3_MOE, KL_MOE):
        for T, rows in ((1, 1), (8, 1), (64, 2)):
            for N, K in ((n13, hidden), (hidden, n13 // 2)):
                assert w4a16_config(T * k, E, N, K, 32, path="tc") == (16, 128, 128, 2, 3), (E, T)
                assert w4a16_config(T * k, E, N, K, 32, path="gemv")[0] == rows, (E, T)
                assert w4a16_config(T * k, E, N, K, 32)[0] == (1 if rows == 1 else 16), (E, T)
                assert w4a16.decode_path(T * k, E) == ("gemv" if rows == 1 else "split"), (E, T)
            assert w4a16_glu_config(T * k, E, n13 // 2, hidden, path="tc") == (16, 64, 128, 2, 3)
            assert w4a16_glu_config(T * k, E, n13 // 2, hidden)[0] == (1 if rows == 1 else 16)
            BM, BN, BK, _, _ = w4a16_glu_config(T * k, E, n13 // 2, hidden, path="gemv")
            # the FMA GLU kernel's tiles halved again where they leave under two programs a SM (Kimi Linear, batch 1)
            few = (E, T) == (KL_MOE[1], 1)
            assert BM == rows and BN == w4a16_config(T * k, E, n13, hidden, 32, path="gemv")[1] // (4 if few else 2)
        assert w4a16_config(8192 * k, E, n13, hidden, 32)[0] == 128
    assert w4a16_config(2048 * 16, 896, 6144, 3584, 32)[0] == 64
    assert [decode_rows(m, 1) for m in (1, 2, 3, 4, 5)] == [1, 2, 2, 4, None]
    assert [w4a16.decode_path(m, 1) for m in (1, 2, 4, 16)] == ["gemv", "split", "tc", "tc"]
    assert w4a16_config(16, 1, 7168, 7168, 32)[0] == 16               # dense M=16: the tensor-core decode kernel
    assert w4a16_config(17, 1, 7168, 7168, 32)[0] == 64
    assert w4a16_config(8, 1, 7168, 7168, 32, decode=False)[1] == 32   # other activations: the general 16-row tiles
    # the decode grid's bound holds every expert's tiles
    for counts in (COUNTS, [9, 0, 0, 1], [1] * 6):
        S = sum(counts)
        for rows in (1, 2, 4):
            assert sum(-(-c // rows) for c in counts) <= decode_tiles(S, len(counts), True, rows)
        assert sum(c == 1 for c in counts) <= decode_tiles(S, len(counts), True, 1, sel=1)


SPLIT_COUNTS = [1, 2, 0, 1, 3, 1, 5, 0, 1, 2]     # 16 rows over 10 experts: ~2 per touched one, four hold one


@pytest.mark.parametrize("fmt,glu", [("mxfp4", False), ("nvfp4 modelopt", False), ("nvfp4", True)])
def test_split_decode_runs_one_row_experts_on_the_fma_kernel_and_the_rest_on_tensor_cores(fmt, glu):
    """At ~2 rows per touched expert the host splits the decode GEMM (path "split"): the FMA kernel writes the rows
    of the experts holding one row and the tensor-core kernel the others, each row bit for bit what that kernel
    alone gives at the same config, every row written (the output starts as NaN) and within the reference's bound."""
    g = gen(31 + len(fmt) + glu)
    E, T, N, K = len(SPLIT_COUNTS), 12, 128, 256
    offs, ids = _routing(SPLIT_COUNTS, T, g)
    S = int(offs[-1])
    assert w4a16.decode_path(S, E) == "split"
    w = _weights(fmt, E, N, K, g)
    x = torch.randn((T, K), generator=g).to(torch.bfloat16).to(DEVICE)
    args = (x, w["packed"], w["scale"], w["second"], w["divisor"], offs, ids)
    if glu:
        run = lambda **kw: w4a16_glu_gemm(*args, "situ", **kw)
        tc_cfg = w4a16_glu_config(S, E, N // 2, K)
        fma_cfg = (1,) + w4a16_glu_config(S, E, N // 2, K, path="gemv")[1:]
        ref = W4A16GroupedGemmGlu.reference(x, w["packed"], w["scale"], offs, ids, w["second"], w["divisor"], "situ")
        width, compare = N // 2, W4A16GroupedGemmGlu.compare
    else:
        run = lambda **kw: w4a16_gemm(*args, **kw)
        tc_cfg = w4a16_config(S, E, N, K, 32)
        fma_cfg = (1,) + w4a16_config(S, E, N, K, 32, path="gemv")[1:]
        ref = W4A16GroupedGemm.reference(x, w["packed"], w["scale"], offs, w["second"], w["divisor"], ids)
        width, compare = N, W4A16GroupedGemm.compare
    assert tc_cfg[0] == 16
    y = run(out=torch.full((S, width), float("nan"), dtype=torch.bfloat16, device=DEVICE))
    assert not y.isnan().any()
    one = torch.tensor(SPLIT_COUNTS, device=DEVICE).repeat_interleave(torch.tensor(SPLIT_COUNTS, device=DEVICE)) == 1
    assert 0 < int(one.sum()) < S
    assert torch.equal(y[one], run(config=fma_cfg)[one])
    assert torch.equal(y[~one], run(config=tc_cfg)[~one])
    compare(y, ref)


def test_fp32_activations_take_the_tiles_and_explicit_decode_configs_refuse_them():
    """The decode kernel reads bf16 pairs: fp32 activations (the CPU targets run fp32) at decode shapes take the
    tensor-core tiles, writing only their output rows; a decode config forced on them is refused in one line."""
    g = gen(5)
    counts = COUNTS[:-1]                                         # ~2.7 rows per touched expert
    E, T, N, K = len(counts), 10, 64, 64
    offs, ids = _routing(counts, T, g)
    S = int(offs[-1])
    w = _weights("nvfp4", E, N, K, g)
    x = torch.randn((T, K), generator=g).to(DEVICE)
    assert w4a16_config(S, E, N, K, 32)[0] == 16                 # bf16 at this shape would take a decode kernel
    assert w4a16_config(S, E, N, K, 32, path="gemv")[0] in (1, 2, 4)
    big = torch.full((S + 8, N), 777.0, device=DEVICE)
    y = w4a16_gemm(x, w["packed"], w["scale"], w["second"], w["divisor"], offs, ids, out=big[4:4 + S])
    assert (big[:4] == 777).all() and (big[4 + S:] == 777).all()
    W4A16GroupedGemm.compare(y, W4A16GroupedGemm.reference(x, w["packed"], w["scale"], offs, w["second"],
                                                           w["divisor"], ids))
    with pytest.raises(ValueError, match="bf16 activations"):
        w4a16_gemm(x, w["packed"], w["scale"], w["second"], w["divisor"], offs, ids, config=(2, 64, 64, 4, 1))
    w2 = _weights("nvfp4", E, 2 * 32, K, g)
    with pytest.raises(ValueError, match="bf16 activations"):
        w4a16_glu_gemm(x, w2["packed"], w2["scale"], w2["second"], w2["divisor"], offs, ids, "silu",
                       config=(2, 32, 64, 4, 1))


# ---------------------------------------------------------------------------------------------------------------
# The tensor-core decode kernel (kestrel/kernels/quant/w4a16_tc.py, config BM 16) runs in the tests above: here
# (TRITON_INTERPRET) its pure-Triton decode, on CUDA its inline PTX. The PTX itself is checked on the CPU by
# executing it instruction by instruction (`_run_decode_ptx`) over every byte.

def _bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def _bf16_bits(v: float) -> int:
    return int(torch.tensor([v], dtype=torch.float64).float().to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def _run_decode_ptx(word: int, s01: int, s23: int) -> list[int]:
    """Execute w4a16_tc's decode PTX on one packed word and two bf16x2 scale words: [$0, $1, $2, $3]."""
    from kestrel.kernels.quant.w4a16_tc import _DECODE_PTX
    reg = {"$4": word, "$5": s01, "$6": s23}
    val = lambda t: reg[t] if t in reg else int(t, 0)           # noqa: E731
    for line in str(_DECODE_PTX.value).splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        a = [val(t) for t in src]
        if op == "prmt.b32":
            pool = [(a[0] >> 8 * i) & 0xFF for i in range(4)] + [(a[1] >> 8 * i) & 0xFF for i in range(4)]
            out = 0
            for i in range(4):
                sel = (a[2] >> 4 * i) & 0xF
                byte = pool[sel & 7]
                out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << 8 * i
        elif op == "and.b32":
            out = a[0] & a[1]
        elif op == "mul.lo.u32":
            out = (a[0] * a[1]) & 0xFFFFFFFF
        elif op == "mul.rn.bf16x2":      # the products are exact in bf16 (asserted by the caller's comparison)
            out = sum(_bf16_bits(_bf16_value((a[0] >> 16 * h) & 0xFFFF) * _bf16_value((a[1] >> 16 * h) & 0xFFFF))
                      << 16 * h for h in range(2))
        else:
            raise AssertionError(f"the decode PTX uses {op}: teach _run_decode_ptx its semantics")
        reg[d] = out
    return [reg[f"${i}"] for i in range(4)]


def test_decode_ptx_gives_e2m1_times_scale_for_every_byte():
    """The inline PTX (run here instruction by instruction): for every byte and per-element scales over the
    kernel's range (MXFP4 2**(code - 64) for codes 58, 64, 65, 127, 191; NVFP4 e4m3 x 2**63 incl. the smallest
    subnormal and 448), output pair p of the low (high) nibbles is e2m1(nibble) x 2**-126 x scale, exact."""
    from kestrel.quant.codes import e2m1_decode
    scales = [2.0 ** (c - 64) for c in (58, 64, 65, 127, 191)] + [v * 2.0 ** 63 for v in (2.0 ** -9, 0.875, 448.0)]
    byte_values = list(range(256))
    for si, s in enumerate(scales):
        for j in range(0, 256, 4):
            b = byte_values[j:j + 4]
            sc = [scales[(si + i) % len(scales)] for i in range(4)]       # a different scale per element
            bits = [_bf16_bits(v) for v in sc]
            assert all(_bf16_value(x) == v for x, v in zip(bits, sc))
            out = _run_decode_ptx(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, bits[0] | bits[1] << 16,
                                  bits[2] | bits[3] << 16)
            for i in range(4):
                for half, nib in ((0, b[i] & 15), (2, b[i] >> 4)):
                    got = _bf16_value((out[half + i // 2] >> 16 * (i % 2)) & 0xFFFF)
                    want = float(e2m1_decode(torch.tensor([nib], dtype=torch.uint8))[0]) * 2.0 ** -126 * sc[i]
                    assert got == want, (b[i], half, sc[i], got, want)


def test_tc_decode_refuses_rows_it_cannot_align():
    """The kernel promises Triton 16-byte weight rows and scale rows of whole K steps: a padded view is refused in
    one line rather than read misaligned."""
    g = gen(8)
    N, K = 32, 128
    w = random_fp4_weight("mxfp4", (), N, K, g, DEVICE)
    padded = torch.zeros((N, K // 2 + 4), dtype=torch.uint8, device=DEVICE)[:, :K // 2]
    padded.copy_(w["packed"])
    x = torch.randn((2, K), generator=g).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="tensor-core decode"):
        w4a16_gemm(x, padded, w["scale"], config=(16, 32, 128, 4, 1))
