"""AddMixRmsNorm driven the way the K3 forward will drive it: the residual stream over several layers and block
starts (fused: 2 launches a layer) equals today's sequence (AttnResMix, AddRmsNorm, in-place adds, block copies),
and is_valid refuses the aliasing the in-place writes cannot survive."""

import pytest
import torch

from kestrel.catalog._op import InvalidInput, validating
from kestrel.catalog.norm.add_mix_rmsnorm import AddMixRmsNorm
from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm
from kestrel.catalog.norm.attn_res_mix import AttnResMix

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T, N, LAYERS, BLOCK = 3, 64, 5, 2
EPS = 1e-5


def _weights(gen):
    def vec(scale, shift=0.0):
        return (torch.randn(N, generator=gen) * scale + shift).to(DEVICE)
    return [dict(attn_mix=vec(2 / N ** 0.5), mlp_mix=vec(2 / N ** 0.5), in_norm=vec(0.1, 1.0),
                 post_norm=vec(0.1, 1.0)) for _ in range(LAYERS)]


def _sublayer(x, seed):
    """A stand-in for attention / FFN: a fixed random map of the normed input (deterministic per seed)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, N, generator=g) / N ** 0.5).to(DEVICE)
    return torch.tanh(x.float() @ w).to(x.dtype)


def _today(emb, layers, dtype):
    """The K3 target's residual stream as it runs today (catalog entries, in-place adds, block copies)."""
    blocks = torch.empty(LAYERS // BLOCK + 2, T, N, dtype=dtype, device=DEVICE)
    nb, partial, inputs, outs = 0, emb.clone(), [], []
    for i, L in enumerate(layers):
        x = AttnResMix.raw_call(blocks[:nb], partial, L["attn_mix"], EPS)
        if i % BLOCK == 0:
            blocks[nb].copy_(partial)
            nb += 1
            partial = None
        xn, _ = AddRmsNorm.raw_call(x, None, L["in_norm"], EPS)
        inputs.append(xn)
        y = _sublayer(xn, 2 * i)
        outs.append(y.clone())
        partial = y if partial is None else partial.add_(y)
        x = AttnResMix.raw_call(blocks[:nb], partial, L["mlp_mix"], EPS)
        xn, _ = AddRmsNorm.raw_call(x, None, L["post_norm"], EPS)
        inputs.append(xn)
        outs.append(_sublayer(xn, 2 * i + 1))
        partial = partial.add_(outs[-1])
    return inputs, outs, blocks[:nb], partial


def _fused(emb, layers, dtype, outs):
    """The same stream with AddMixRmsNorm: the add of the previous sublayer's output, the mix and the norm in one
    launch, the block-start store through r_out. The sublayer outputs are today's (teacher-forced), so a one-ulp
    difference in one normed input cannot grow through later layers and the comparison stays per launch."""
    blocks = torch.empty(LAYERS // BLOCK + 2, T, N, dtype=dtype, device=DEVICE)
    nb, partial, delta, inputs = 0, emb.clone(), None, []
    for i, L in enumerate(layers):
        start = i % BLOCK == 0
        with validating(AddMixRmsNorm):
            xn, r = AddMixRmsNorm.raw_call(delta, partial, blocks[:nb], L["attn_mix"], L["in_norm"], EPS,
                                           r_out=blocks[nb] if start else None)
        if start:
            nb += 1
        inputs.append(xn)
        y = outs[2 * i].clone()
        with validating(AddMixRmsNorm):
            if start:
                partial = y
                xn, _ = AddMixRmsNorm.raw_call(None, partial, blocks[:nb], L["mlp_mix"], L["post_norm"], EPS)
            else:
                partial = r
                xn, partial = AddMixRmsNorm.raw_call(y, partial, blocks[:nb], L["mlp_mix"], L["post_norm"], EPS)
        inputs.append(xn)
        delta = outs[2 * i + 1]
    partial = partial.add_(delta)
    return inputs, blocks[:nb], partial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k3_residual_stream_fused_equals_today(dtype):
    gen = torch.Generator().manual_seed(0)
    layers = _weights(gen)
    emb = (torch.randn(T, N, generator=gen)).to(DEVICE, dtype)
    ins_a, outs, blocks_a, part_a = _today(emb, layers, dtype)
    ins_b, blocks_b, part_b = _fused(emb, layers, dtype, outs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert len(ins_a) == len(ins_b) == 2 * LAYERS
    for j, (a, b) in enumerate(zip(ins_a, ins_b)):
        err = (b.float() - a.float()).abs().max().item()
        assert torch.allclose(b.float(), a.float(), rtol=tol, atol=tol), f"sublayer input {j}: max err {err:.3g}"
    # the adds round the same way in both: the stored blocks and the partial are bit-equal
    torch.testing.assert_close(blocks_b.float().cpu(), blocks_a.float().cpu(), rtol=0, atol=0)
    torch.testing.assert_close(part_b.float().cpu(), part_a.float().cpu(), rtol=0, atol=0)


def _inputs(over):
    gen = torch.Generator().manual_seed(1)
    base = dict(delta=torch.randn(T, N, generator=gen), partial=torch.randn(T, N, generator=gen),
                blocks=torch.randn(2, T, N, generator=gen), w=torch.randn(N, generator=gen) / N,
                norm_weight=torch.ones(N), eps=EPS)
    base = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in base.items()}
    base.update(over(base))
    return base


@pytest.mark.parametrize("over,needle", [
    (lambda i: dict(r_out=i["blocks"][1]), "r_out overlaps"),
    (lambda i: dict(delta=i["partial"]), "delta and partial overlap"),
    (lambda i: dict(partial=i["blocks"][0]), "partial overlaps the stored blocks"),
    (lambda i: dict(w=i["w"].to(torch.bfloat16)), "w must be contiguous fp32"),
    (lambda i: dict(out=i["delta"]), "out overlaps"),
])
def test_is_valid_refuses(over, needle):
    inp = _inputs(over)
    with validating(AddMixRmsNorm), pytest.raises(InvalidInput, match=needle):
        AddMixRmsNorm.raw_call(**inp)
