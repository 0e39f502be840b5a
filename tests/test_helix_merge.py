"""Helix's merge: attention over keys split into R disjoint shards, merged by the shards' log-sum-exps, equals the
attention over all keys within fp32 rounding. The plain-torch merge (`ops.attention.merge_attention_partials`) and
the Triton kernel (`MergeAttentionPartials`, under TRITON_INTERPRET=1 on the CPU) are both checked; the GPU cases
run the absorbed MLA shapes of K3 (96 heads x 576 -> 512 latent) and Kimi Linear (32 heads)."""

from __future__ import annotations

import pytest
import torch

from kestrel.catalog._op import validating
from kestrel.catalog.attention.helix_merge import MergeAttentionPartials
from kestrel.ops.attention import attention, merge_attention_partials

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sharded(q, kv, L_v, R, scale, visible, cuts=None):
    """(outs [R, T, H, Dv], lses [R, T, H]) of absorbed attention (one latent head: k = kv, v = kv[:, :L_v]) over R
    consecutive key shards; a shard a query sees nothing of has LSE -inf (its NaN output zeroed as a rank would)."""
    L = kv.shape[0]
    cuts = cuts or [L * r // R for r in range(R + 1)]
    outs, lses = [], []
    for r in range(R):
        sl = slice(cuts[r], cuts[r + 1])
        o, lse = attention(q.transpose(0, 1), kv[sl], kv[sl, :L_v], scale, visible[:, sl])   # [H, T, Dv], [H, T]
        outs.append(torch.nan_to_num(o.transpose(0, 1), nan=0.0))
        lses.append(lse.transpose(0, 1))
    return torch.stack(outs), torch.stack(lses)


def _problem(T, H, W, L, gen, device):
    q = torch.randn(T, H, W, generator=gen).to(device)
    kv = torch.randn(L, W, generator=gen).to(device)
    visible = torch.rand(T, L, generator=gen) < 0.7
    visible[:, 0] = True
    return q, kv, visible.to(device)


@pytest.mark.parametrize("R,T,H,W,Lv,L", [(2, 3, 4, 24, 16, 11), (4, 2, 3, 40, 32, 9), (3, 4, 2, 12, 8, 2)])
def test_sharded_keys_merge_to_unsharded_attention(R, T, H, W, Lv, L):
    gen = torch.Generator().manual_seed(R * 100 + L)
    q, kv, visible = _problem(T, H, W, L, gen, "cpu")
    visible[0, 1:] = False          # query 0 sees only key 0: every other shard is empty (LSE -inf) for it
    full, full_lse = attention(q.transpose(0, 1), kv, kv[:, :Lv], W ** -0.5, visible)
    outs, lses = _sharded(q, kv, Lv, R, W ** -0.5, visible)
    assert torch.isinf(lses[:, 0]).all(dim=-1).any(), "the test must include an empty shard"
    merged = merge_attention_partials(outs, lses)
    torch.testing.assert_close(merged, full.transpose(0, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.logsumexp(lses, dim=0), full_lse.transpose(0, 1), rtol=1e-5, atol=1e-6)
    with validating(MergeAttentionPartials):
        kernel = MergeAttentionPartials.raw_call(outs, lses)
    torch.testing.assert_close(kernel, full.transpose(0, 1), rtol=1e-5, atol=1e-6)


def test_empty_shard_output_is_ignored_and_unseen_rows_are_zero():
    outs = torch.randn(3, 2, 2, 8)
    lses = torch.randn(3, 2, 2)
    outs[1], lses[1] = float("nan"), float("-inf")          # shard 1 empty everywhere, holding garbage
    lses[:, 1, 1] = float("-inf")                           # row (1, 1): no shard sees a key
    merged = merge_attention_partials(outs, lses)
    two = merge_attention_partials(outs[[0, 2]], lses[[0, 2]])
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged, two)
    assert (merged[1, 1] == 0).all()
    with validating(MergeAttentionPartials):
        torch.testing.assert_close(MergeAttentionPartials.raw_call(outs, lses), merged, rtol=1e-6, atol=1e-6)


def test_uneven_shards_match():
    gen = torch.Generator().manual_seed(3)
    q, kv, visible = _problem(3, 2, 16, 10, gen, "cpu")
    full, _ = attention(q.transpose(0, 1), kv, kv[:, :12], 0.25, visible)
    outs, lses = _sharded(q, kv, 12, 4, 0.25, visible, cuts=[0, 1, 1, 7, 10])     # shard 1 holds no key at all
    torch.testing.assert_close(merge_attention_partials(outs, lses), full.transpose(0, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real-width MLA shapes run on the GPU")
@pytest.mark.parametrize("R,H,L", [(16, 96, 4096), (8, 96, 1000), (2, 32, 2048), (4, 32, 777)],
                         ids=["K3 helix16", "K3 helix8", "Kimi Linear helix2", "Kimi Linear helix4"])
def test_real_width_mla_decode_merges_to_unsharded(R, H, L):
    """Absorbed MLA decode at the models' widths: 576-wide latent keys, 512-wide values, 8 decode tokens."""
    gen = torch.Generator().manual_seed(R + H)
    q, kv, visible = _problem(8, H, 576, L, gen, "cuda")
    scale = (128 + 64) ** -0.5
    full, _ = attention(q.transpose(0, 1), kv, kv[:, :512], scale, visible)
    outs, lses = _sharded(q, kv, 512, R, scale, visible)
    torch.testing.assert_close(merge_attention_partials(outs, lses), full.transpose(0, 1), rtol=1e-5, atol=1e-5)
    with validating(MergeAttentionPartials):
        kernel = MergeAttentionPartials.raw_call(outs, lses)
        bf16 = MergeAttentionPartials.raw_call(outs.bfloat16(), lses)
    torch.testing.assert_close(kernel, full.transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bf16.float(), full.transpose(0, 1), rtol=1e-2, atol=1e-2)
