"""KdaDecode beyond the cell driver: several decode steps equal one pass of the separate references over the whole
sequence, the fused kernel equals today's launch sequence (ShortConv, KdaGate, KdaRecurrent, GatedRmsNorm),
padding rows leave every state alone, is_valid refuses what the kernel would answer wrong, and (GPU) a captured
CUDA graph replays it. Triton runs under the interpreter on the CPU (conftest.py): shapes stay tiny."""

import pytest
import torch

from kestrel.catalog._op import InvalidInput, validating
from kestrel.catalog.kda.conv import ShortConv
from kestrel.catalog.kda.decode import KdaDecode
from kestrel.catalog.kda.gate import KdaGate
from kestrel.catalog.kda.recurrent import KdaRecurrent
from kestrel.catalog.norm.gated_rmsnorm import GatedRmsNorm
from kestrel.kernels.kda.decode import kda_decode
from kestrel.ops.kda import gates, recurrence_varlen, short_conv_varlen
from kestrel.ops.norm import gated_rms_norm
from helpers import compile_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(seed, **spec):
    spec = {"B": 3, "H": 2, "D": 16, "gate": "kimi", "dtype": torch.float32, **spec}
    return KdaDecode.make_inputs(spec, DEVICE, torch.Generator().manual_seed(seed))


def _close(a, b, rtol=1e-4, atol=1e-5, what=""):
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), rtol=rtol, atol=atol, msg=what or None)


def _fresh_rows(inp, gen):
    """New projected rows for the next decode step, same shapes and dtypes."""
    return {n: torch.randn(inp[n].shape, generator=gen).to(device=DEVICE, dtype=inp[n].dtype)
            for n in ("mixed", "f", "b", "gate")}


@pytest.mark.parametrize("gate", ["kimi", "k3"])
def test_steps_equal_one_pass_over_the_sequence(gate):
    """Three decode steps per request == kestrel.ops' conv, gates, token-loop recurrence and gated norm over each
    request's 3-token segment at once (states, and every step's output)."""
    gen = torch.Generator().manual_seed(5)
    inp = _inputs(1, gate=gate)
    B, H, D = 3, 2, 16
    conv0, rec0 = inp["conv_state"].clone(), inp["rec_state"].clone()
    steps = [_fresh_rows(inp, gen) for _ in range(3)]
    ys = []
    for rows in steps:
        with validating(KdaDecode):
            y, _, _ = KdaDecode.raw_call(**{**inp, **rows})
        ys.append(y)

    # the same tokens as segments of 3, request-major
    def seq(name):
        return torch.stack([s[name] for s in steps], 1).reshape(B * 3, -1)
    cu = torch.arange(0, 3 * B + 1, 3, dtype=torch.int32, device=DEVICE)
    qkv, _ = short_conv_varlen(seq("mixed"), inp["conv_weight"], conv0, cu, inp["slots"])
    q, k, v = (t.reshape(-1, H, D) for t in qkv.split(H * D, dim=-1))
    g, beta = gates(seq("f"), inp["A_log"], inp["dt_bias"], seq("b"), inp["lower_bound"])
    o, _ = recurrence_varlen(q, k, v, g, beta, rec0, cu, inp["slots"])
    y_ref = gated_rms_norm(o.reshape(-1, D), seq("gate").reshape(-1, D), inp["norm_weight"], inp["eps"])
    y_ref = y_ref.reshape(B, 3, H * D)
    for t in range(3):
        _close(ys[t], y_ref[:, t], what=f"step {t} output")
    _close(inp["conv_state"], conv0, rtol=0, atol=0, what="conv state pool")
    _close(inp["rec_state"], rec0, what="recurrent state pool")


def test_equals_todays_launch_sequence():
    """fp32 model dtype: the one kernel == ShortConv -> KdaGate -> KdaRecurrent -> GatedRmsNorm (the launches it
    replaces in catalog/_layers.kda), outputs and both pools."""
    inp = _inputs(2, B=4, H=2, D=32, gate="k3")
    H, D = 2, 32
    conv2, rec2 = inp["conv_state"].clone(), inp["rec_state"].clone()
    cu = torch.arange(5, dtype=torch.int32, device=DEVICE)
    qkv, _ = ShortConv.raw_call(inp["mixed"], inp["conv_weight"], conv2, cu, inp["slots"])
    q, k, v = (t.view(-1, H, D) for t in qkv.split(H * D, dim=-1))
    g, beta = KdaGate.raw_call(inp["f"], inp["A_log"], inp["dt_bias"], inp["b"], inp["lower_bound"])
    o, _ = KdaRecurrent.raw_call(q, k, v, g, beta, rec2, cu, inp["slots"])
    y2 = GatedRmsNorm.raw_call(o.view(-1, D), inp["gate"].reshape(-1, D), inp["norm_weight"], inp["eps"])
    y, conv, rec = KdaDecode.raw_call(**inp)
    _close(y, y2.view(4, -1), what="y")
    _close(conv, conv2, rtol=0, atol=0, what="conv state")
    _close(rec, rec2, what="recurrent state")


def test_padding_rows_write_nothing():
    """Rows on pad_slot: zero output, pad slot bit-unchanged; the real rows equal a call without the padding."""
    inp = _inputs(3, B=5, pad=3, gate="k3", dtype=torch.bfloat16)
    pad = inp["pad_slot"]
    assert (inp["slots"] == pad).sum() == 3
    conv0, rec0 = inp["conv_state"].clone(), inp["rec_state"].clone()
    real = {n: (t[:2] if n in ("mixed", "f", "b", "gate", "slots") else t) for n, t in inp.items()}
    real = {**real, "conv_state": conv0.clone(), "rec_state": rec0.clone(), "pad_slot": -1}
    with validating(KdaDecode):
        y, conv, rec = KdaDecode.raw_call(**inp)
        y_real, conv_real, rec_real = KdaDecode.raw_call(**real)
    assert torch.count_nonzero(y[2:]) == 0
    _close(y[:2], y_real, rtol=0, atol=0, what="real rows")
    _close(conv, conv_real, rtol=0, atol=0, what="conv pool")
    _close(rec, rec_real, rtol=0, atol=0, what="recurrent pool")
    _close(conv[pad], conv0[pad], rtol=0, atol=0, what="scratch conv slot")
    _close(rec[pad], rec0[pad], rtol=0, atol=0, what="scratch recurrent slot")


@pytest.mark.parametrize("block_v,prefetch", [(8, True), (8, False), (32, True), (32, False)])
def test_block_configs_match_the_reference(block_v, prefetch):
    """The state streams in [D, BV] blocks: 4 blocks with and without the next block prefetched, and the whole
    head as one block, all equal the entry's reference (y and both pools), padding rows included."""
    inp = _inputs(8, B=4, pad=1, H=2, D=32, gate="kimi", dtype=torch.bfloat16)
    ref = KdaDecode.reference(**{**inp, "conv_state": inp["conv_state"].clone(),
                                 "rec_state": inp["rec_state"].clone()})
    got = kda_decode(**inp, config=dict(block_v=block_v, num_warps=1, prefetch=prefetch))
    KdaDecode.compare(got, ref)


@pytest.mark.parametrize("break_it,needle", [
    (lambda i: i["slots"].__setitem__(1, int(i["slots"][0])), "share a state slot"),
    (lambda i: i.update(conv_state=i["conv_state"].to(torch.bfloat16)), "conv_state dtype"),
    (lambda i: i.update(out=i["gate"]), "out aliases"),
    (lambda i: i.update(mixed=i["mixed"][:, :-1]), "mixed must be"),
    (lambda i: i.update(rec_state=i["rec_state"].transpose(2, 3)), "rec_state must be"),
    (lambda i: i.update(slots=i["slots"].long()), "int32"),
])
def test_is_valid_refuses(break_it, needle):
    inp = _inputs(4)
    break_it(inp)
    with validating(KdaDecode), pytest.raises(InvalidInput, match=needle):
        KdaDecode.raw_call(**inp)


def test_is_valid_refuses_a_head_wider_than_the_kernel_is_built_for():
    inp = _inputs(5, B=1, H=1, D=256)
    assert "power of two in [16, 128]" in KdaDecode.is_valid(**inp)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_eager():
    """Captured once on static buffers, replayed on new rows: same outputs and states as eager calls."""
    inp = _inputs(6, B=8, H=32, D=128, pad=2, gate="kimi", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    eager_conv, eager_rec = inp["conv_state"].clone(), inp["rec_state"].clone()
    out = torch.empty_like(inp["gate"])
    static = {**inp, "out": out}
    KdaDecode.raw_call(**{**static, "conv_state": inp["conv_state"].clone(), "rec_state": inp["rec_state"].clone()})
    graph = torch.cuda.CUDAGraph()
    snap_conv, snap_rec = inp["conv_state"].clone(), inp["rec_state"].clone()
    with torch.cuda.graph(graph):
        KdaDecode.raw_call(**static)
    inp["conv_state"].copy_(snap_conv)      # capture does not run the kernel, but be explicit about the start
    inp["rec_state"].copy_(snap_rec)
    for _ in range(3):
        rows = _fresh_rows(inp, gen)
        for n, t in rows.items():
            static[n].copy_(t)
        graph.replay()
        y_eager, _, _ = KdaDecode.raw_call(**{**inp, **rows, "conv_state": eager_conv, "rec_state": eager_rec,
                                              "out": None})
        torch.cuda.synchronize()
        _close(out, y_eager, rtol=0, atol=0, what="graph vs eager y")
    _close(inp["conv_state"], eager_conv, rtol=0, atol=0)
    _close(inp["rec_state"], eager_rec, rtol=0, atol=0)


_COMPILE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kestrel.kernels.kda.decode import _kda_decode_kernel as K, launch_config

n = 0
for H, use_lb in ((32, False), (96, True)):        # Kimi Linear 48B, K3 tp1 at D = 128
    cfg = launch_config(128)
    const = dict(H=H, D=128, KW=4, KP=4, USE_LB=use_lb, BV=cfg["block_v"], PREFETCH=cfg["prefetch"])
    sig = {}
    for name in inspect.signature(K.fn).parameters:
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = {"rs_ptr": "*fp32", "slots_ptr": "*i32", "a_log_ptr": "*fp32", "dt_ptr": "*fp32"}.get(
                name, "*bf16")
        else:
            sig[name] = "fp32" if name in ("scale", "eps", "lower_bound") else "i32"
    src = ASTSource(fn=K, signature=sig, constexprs=const)
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]}).asm["cubin"]
    n += 1
print("cubins", n)
"""


def test_kda_decode_compiles_for_the_h200():
    """The interpreter runs the kernel as Python; this compiles it for sm_90 with the launch config of the real
    widths (no GPU needed; a process without TRITON_INTERPRET), so a block loop the compiler rejects is caught here."""
    assert "cubins 2" in compile_for_sm90(_COMPILE, fp_fusion=True)
