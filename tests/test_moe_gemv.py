"""The bf16 experts' decode GEMVs (kestrel/kernels/moe/expert_gemv.py, entries MoeGemvGlu / MoeGemv) against the
grouped GEMMs' plain-torch references on fresh random inputs: every rows-per-program choice (1, 2, 4, 8) with
1..8 live rows, untouched experts, an expert spanning several programs (a bound below its rows), partial N and K
steps, SiLU and SiTU; the entries' row bound; `Bf16Experts.small` choosing them up to GEMV_TOKENS tokens; and the
kernel compiling for sm_90 at the real widths."""

import pytest
import torch

from kestrel.catalog._layers import GEMV_TOKENS, Bf16Experts
from kestrel.catalog._op import InvalidInput, validating
from kestrel.catalog.moe.gemv import MoeGemv
from kestrel.catalog.moe.gemv_glu import MoeGemvGlu
from kestrel.catalog.moe.grouped_gemm import MoeGroupedGemm
from kestrel.catalog.moe.grouped_gemm_glu import MoeGroupedGemmGlu, compare_glu
from kestrel.kernels.moe.expert_gemv import MAX_ROWS, expert_gemv, gemv_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COUNTS = [0, 1, 2, 3, 4, 5, 8, 0, 7, 6]          # rows per expert: empty ones and every live count up to 8


def _routing(counts, T, g):
    """expert_offsets for `counts` rows per expert, token ids in [0, T) (each token at most once an expert)."""
    offs = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
    ids = torch.cat([torch.randperm(T, generator=g)[:c] for c in counts]).to(torch.int32)
    return offs.to(DEVICE), ids.to(DEVICE)


def _bf16(shape, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("max_rows,act,I,K,config", [
    (8, "silu", 32, 64, (16, 64, 4, 2)),
    (4, "situ", 40, 72, (16, 64, 4, 2)),     # partial column tile, K = a step + a partial one; experts of
                                             # 5..8 rows span two 4-row programs
    (2, "silu", 24, 48, (8, 32, 2, 2)),
    (1, "situ", 16, 64, (16, 64, 4, 2)),     # one row a program: every expert split into its rows
])
def test_glu_gemv_matches_the_grouped_reference(max_rows, act, I, K, config):
    g = torch.Generator().manual_seed(max_rows * 13 + I)
    T, E = 9, len(COUNTS)
    offs, ids = _routing(COUNTS, T, g)
    x = _bf16((T, K), g)
    w13 = _bf16((E, 2 * I, K), g, 2 * K ** -0.5)
    h = expert_gemv(x, w13, offs, max_rows, ids, glu=True, act=act, config=config)
    MoeGemvGlu.compare(h, MoeGroupedGemmGlu.reference(x, w13, offs, ids, act))


@pytest.mark.parametrize("max_rows,N,K,config", [
    (8, 64, 32, (32, 32, 4, 2)),
    (4, 40, 72, (16, 64, 4, 2)),
    (2, 48, 64, (16, 64, 4, 2)),
])
def test_plain_gemv_matches_the_grouped_reference(max_rows, N, K, config):
    g = torch.Generator().manual_seed(max_rows * 7 + N)
    S = sum(COUNTS)
    offs, _ = _routing(COUNTS, 9, g)
    x = _bf16((S, K), g)
    w = _bf16((len(COUNTS), N, K), g, K ** -0.5)
    y = expert_gemv(x, w, offs, max_rows, config=config)
    MoeGemv.compare(y, MoeGroupedGemm.reference(x, w, offs))


def test_gemv_writes_into_out_and_leaves_the_rest():
    g = torch.Generator().manual_seed(5)
    counts = [2, 0, 1, 3]
    offs, _ = _routing(counts, 4, g)
    x = _bf16((6, 32), g)
    w = _bf16((4, 16, 32), g, 32 ** -0.5)
    out = torch.full((6, 16), 7.0, dtype=torch.bfloat16, device=DEVICE)
    with validating(MoeGemv):
        y = MoeGemv.raw_call(x, w, offs, 4, out=out)
    assert y is out
    MoeGemv.compare(out, MoeGroupedGemm.reference(x, w, offs))


def test_rows_per_program_choices():
    assert [gemv_rows(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert GEMV_TOKENS <= MAX_ROWS


def test_the_entries_refuse_a_wrong_row_bound():
    g = torch.Generator().manual_seed(9)
    counts = [3, 1, 0, 2]
    offs, ids = _routing(counts, 4, g)
    x = _bf16((4, 32), g)
    w13 = _bf16((4, 32, 32), g)
    with validating(MoeGemvGlu):
        with pytest.raises(InvalidInput, match="more than max_rows 2"):
            MoeGemvGlu.raw_call(x, w13, offs, ids, 2)
        with pytest.raises(InvalidInput, match="must be an int in 1..8"):
            MoeGemvGlu.raw_call(x, w13, offs, ids, 9)
    with validating(MoeGemv):
        with pytest.raises(InvalidInput, match="must be an int in 1..8"):
            MoeGemv.raw_call(_bf16((6, 16), g), _bf16((4, 32, 16), g), offs, 0)


class _Config:
    num_experts, num_experts_per_tok, hidden_act, situ_beta, situ_linear_beta = 8, 2, "silu", 4.0, 25.0


@pytest.mark.parametrize("T,gemv", [(1, True), (GEMV_TOKENS, True), (GEMV_TOKENS + 1, False)])
def test_small_experts_run_the_gemvs_up_to_gemv_tokens(T, gemv, monkeypatch):
    """Bf16Experts.small (with the shared expert stacked as expert E): the GEMVs up to GEMV_TOKENS tokens, the
    grouped GEMMs past them, and the same expert rows either way."""
    c = _Config()
    g = torch.Generator().manual_seed(T)
    E, I, H = c.num_experts, 16, 32
    L = dict(w13=_bf16((E + 1, 2 * I, H), g, 2 * H ** -0.5), w2=_bf16((E + 1, H, I), g, I ** -0.5),
             shared_expert=True)
    x = _bf16((T, H), g)
    ids = torch.rand((T, E), generator=g).topk(2, dim=-1).indices.to(torch.int32).to(DEVICE)
    weights = torch.rand((T, 2), generator=g).to(DEVICE)
    ran = []
    for entry in (MoeGemvGlu, MoeGemv, MoeGroupedGemmGlu, MoeGroupedGemm):
        raw = entry.__dict__["raw_call"].__func__

        def spy(*a, _raw=raw, _name=entry.__name__, **kw):
            ran.append(_name)
            return _raw(*a, **kw)
        monkeypatch.setattr(entry, "raw_call", staticmethod(spy))
    y, w, slot_to_sorted = Bf16Experts.small(L, x, ids, weights, c)
    assert ran == (["MoeGemvGlu", "MoeGemv"] if gemv else ["MoeGroupedGemmGlu", "MoeGroupedGemm"])
    perm_offsets = torch.zeros(E + 2, dtype=torch.int64)
    all_ids = torch.cat([ids.cpu().long(), torch.full((T, 1), E)], dim=1)
    perm_offsets[1:] = torch.bincount(all_ids.flatten(), minlength=E + 1).cumsum(0)
    order = torch.sort(all_ids.flatten(), stable=True).indices
    offs = perm_offsets.to(torch.int32).to(DEVICE)
    h = MoeGroupedGemmGlu.reference(x, L["w13"], offs, (order // 3).to(torch.int32).to(DEVICE), "silu")
    ref = MoeGroupedGemm.reference(h, L["w2"], offs)
    if gemv:
        MoeGemv.compare(y, ref)
    else:       # the grouped GLU kernel's h cast truncates under the interpreter: its own tolerance, carried on
        compare_glu(y, ref, "grouped path")


_COMPILE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kestrel.kernels.moe import expert_gemv as G

PTRS = {"x_ptr": "*bf16", "rows_ptr": "*i32", "w_ptr": "*bf16", "y_ptr": "*bf16", "offs_ptr": "*i32"}
n = 0
for glu, rows, N, K in ((True, 1, 1024, 2304), (True, 8, 1024, 2304), (False, 2, 2304, 1024),
                        (False, 4, 3584, 3072)):
    BN, BK, warps, stages = G.gemv_config(glu, rows, N, K)
    const = dict(GLU=glu, GATHER=glu, ACT=0, E_PAD=512, ROWS=rows, BN=BN, BK=BK, EVEN_K=K % BK == 0,
                 RNE_BF16=False, STAGES=stages)
    sig, attrs = {}, {}
    for i, name in enumerate(inspect.signature(G._expert_gemv_kernel.fn).parameters):
        sig[name] = "constexpr" if name in const else PTRS.get(name, "fp32" if "beta" in name else "i32")
        if name in PTRS or name in ("N", "K", "s_x", "s_we", "s_wn", "s_y"):
            attrs[(i,)] = [["tt.divisibility", 16]]       # as the launcher specializes them at these widths
    k = triton.compile(ASTSource(fn=G._expert_gemv_kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
    assert k.asm["cubin"] and "cp.async" in k.asm["ptx"], "the weight loads are no longer pipelined"
    n += 1
print("cubins", n)
"""


def test_expert_gemv_compiles_for_the_h200():
    """The interpreter runs the kernel as Python; this compiles it for sm_90 as Bf16Experts.small launches it (no
    GPU needed; a process without TRITON_INTERPRET), so control flow the compiler rejects is caught on the CPU."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "cubins 4" in done.stdout, done.stderr[-3000:]
