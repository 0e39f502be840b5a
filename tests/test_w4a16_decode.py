"""The W4A16 decode kernels (kestrel/kernels/quant/w4a16_gemv.py: fp32 FMA over packed words, 1, 2 or 4 rows per
program) against the plain-torch reference: every byte and scale code bit for bit, fresh random weights and
activations with 0..8 rows per expert (untouched experts, experts spanning several tiles), MXFP4 and both NVFP4
tensor-scale conventions, with and without the fused GLU, K split; and the host's choice of path per shape."""

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
COUNTS = [0, 1, 2, 3, 4, 5, 8, 0, 1]          # rows per expert: untouched ones, and ones past 4 rows (two tiles)


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


@pytest.mark.parametrize("fmt,rows,gather,N,K,BN,BK", [
    ("mxfp4", 1, True, 128, 256, 128, 256),
    ("mxfp4", 2, False, 192, 512, 128, 128),        # a partial N tile
    ("mxfp4", 4, True, 128, 256, 64, 128),
    ("nvfp4", 1, False, 128, 256, 128, 256),
    ("nvfp4", 2, True, 128, 256, 64, 128),
    ("nvfp4 modelopt", 4, False, 256, 512, 256, 256),
])
def test_grouped_decode_matches_reference(fmt, rows, gather, N, K, BN, BK):
    g = gen(rows * 7 + len(fmt) + N)
    E, T = len(COUNTS), 10
    offs, ids = _routing(COUNTS, T, g)
    S = int(offs[-1])
    w = _weights(fmt, E, N, K, g)
    x = torch.randn((T if gather else S, K), generator=g).to(torch.bfloat16).to(DEVICE)
    y = w4a16_gemm(x, w["packed"], w["scale"], w["second"], w["divisor"], offs, ids if gather else None,
                   config=(rows, BN, BK, 4, 1))
    ref = W4A16GroupedGemm.reference(x, w["packed"], w["scale"], offs, w["second"], w["divisor"],
                                     ids if gather else None)
    W4A16GroupedGemm.compare(y, ref)


@pytest.mark.parametrize("fmt,rows,act,I,K,BN,BK", [
    ("mxfp4", 2, "silu", 64, 256, 64, 128),
    ("nvfp4", 4, "situ", 128, 256, 64, 256),
    ("nvfp4 modelopt", 1, "silu", 96, 512, 64, 256),     # a partial intermediate tile
])
def test_grouped_glu_decode_matches_reference(fmt, rows, act, I, K, BN, BK):
    g = gen(rows * 11 + len(act) + I)
    E, T = len(COUNTS), 12
    offs, ids = _routing(COUNTS, T, g)
    w = _weights(fmt, E, 2 * I, K, g)
    x = torch.randn((T, K), generator=g).to(torch.bfloat16).to(DEVICE)
    h = w4a16_glu_gemm(x, w["packed"], w["scale"], w["second"], w["divisor"], offs, ids, act,
                       config=(rows, BN, BK, 4, 1))
    ref = W4A16GroupedGemmGlu.reference(x, w["packed"], w["scale"], offs, ids, w["second"], w["divisor"], act)
    W4A16GroupedGemmGlu.compare(h, ref)


@pytest.mark.parametrize("fmt,rows,split", [("mxfp4", 4, 2), ("nvfp4", 1, 4)])
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


def test_decode_mxfp4_every_byte_and_scale_code_is_exact():
    """All 256 bytes in every nibble position of a word, scale codes over 132 exponents: one-hot activation rows
    make each output a single product, so y^T equals the reference dequantize bit for bit (fp32 out)."""
    N, K = 66, 64
    packed = _every_byte_in_every_word_position(N, K)
    scale = (torch.arange(N * 2).reshape(N, 2) + 60).to(torch.uint8).to(DEVICE)
    y = w4a16_gemm(_one_hot_rows(K), packed, scale, out=torch.empty(K, N, device=DEVICE),
                   config=(4, 128, 64, 4, 1))
    assert torch.equal(y.t().cpu(), dequantize_mx(packed, scale).cpu())


@pytest.mark.parametrize("divisor", [True, False])
def test_decode_nvfp4_every_byte_and_positive_e4m3_scale_is_exact(divisor):
    N, K = 128, 32
    packed = _every_byte_in_every_word_position(N, K)
    scale = torch.arange(1, 127, dtype=torch.uint8).repeat(3)[:2 * N].reshape(N, 2).view(E4M3).to(DEVICE)
    second = torch.ones(N, 1, device=DEVICE)
    y = w4a16_gemm(_one_hot_rows(K), packed, scale, second, divisor, out=torch.empty(K, N, device=DEVICE),
                   config=(2, 64, 32, 4, 1))
    assert torch.equal(y.t().cpu(), dequantize_nvfp4(packed, scale, second, divisor).cpu())


def test_decode_swapped_nibbles_fail_the_comparison():
    """A decode that read the high nibble first would answer a different GEMM: compare must refuse it."""
    g = gen(5)
    N, K = 64, 128
    w = random_fp4_weight("mxfp4", (), N, K, g, DEVICE)
    x = torch.randn((2, K), generator=g).to(torch.bfloat16).to(DEVICE)
    ref = W4A16Linear.reference(x, w["packed"], w["scale"])
    p = w["packed"]
    swapped = ((p >> 4) | (p << 4)).contiguous()
    with pytest.raises(AssertionError):
        W4A16Linear.compare(w4a16_gemm(x, swapped, w["scale"], config=(2, 32, 128, 4, 1)), ref)
    W4A16Linear.compare(w4a16_gemm(x, p, w["scale"], config=(2, 32, 128, 4, 1)), ref)


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
    """The configs the GPU runs: the FMA decode kernels (BM 1, 2 or 4 rows per program) for the models' decode
    batches, the tensor-core tiles past 4 rows per expert and for prefill."""
    monkeypatch.setattr(w4a16, "interpreting", lambda: False)
    from kestrel.kernels.quant import w4a16_glu
    monkeypatch.setattr(w4a16_glu, "interpreting", lambda: False)
    for _, E, k, n13, hidden in (K3_MOE, KL_MOE):
        for T, rows in ((1, 1), (8, 1), (64, 2)):
            assert w4a16_config(T * k, E, n13, hidden, 32)[0] == rows, (E, T)
            assert w4a16_config(T * k, E, hidden, n13 // 2, 32)[0] == rows, (E, T)
            BM, BN, BK, _, _ = w4a16_glu_config(T * k, E, n13 // 2, hidden)
            assert BM == rows and BN == w4a16_config(T * k, E, n13, hidden, 32)[1] // 2
        assert w4a16_config(8192 * k, E, n13, hidden, 32)[0] == 128
    assert w4a16_config(2048 * 16, 896, 6144, 3584, 32)[0] == 64
    assert [decode_rows(m, 1) for m in (1, 2, 3, 4, 5)] == [1, 2, 2, 4, None]
    assert w4a16_config(16, 1, 7168, 7168, 32)[0] == 16               # dense M=16: tensor-core tiles
    # the decode grid's bound holds every expert's tiles
    for counts in (COUNTS, [9, 0, 0, 1], [1] * 6):
        S = sum(counts)
        for rows in (1, 2, 4):
            assert sum(-(-c // rows) for c in counts) <= decode_tiles(S, len(counts), True, rows)


def test_fp32_activations_take_the_tiles_and_explicit_decode_configs_refuse_them():
    """The decode kernel reads bf16 pairs: fp32 activations (the CPU targets run fp32) at decode shapes take the
    tensor-core tiles, writing only their output rows; a decode config forced on them is refused in one line."""
    g = gen(5)
    E, T, N, K = len(COUNTS), 10, 64, 64
    offs, ids = _routing(COUNTS, T, g)
    S = int(offs[-1])
    w = _weights("nvfp4", E, N, K, g)
    x = torch.randn((T, K), generator=g).to(DEVICE)
    assert w4a16_config(S, E, N, K, 32)[0] in (1, 2, 4)          # bf16 at this shape would take the decode kernel
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
