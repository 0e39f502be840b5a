"""KDA kernels beyond the generic cell driver: conv state carry-over for short segments, prefill-then-decode equals
the naive recurrence over the concatenation, batching independence, slot isolation, the torch chunked path, and
strong decays. Triton runs under the interpreter on the CPU (conftest.py), so shapes stay tiny."""

import pytest
import torch

from kestrel.catalog._op import validating
from kestrel.catalog.kda._common import batch_layout, make_kda_inputs, realistic_g
from kestrel.catalog.kda.chunk import KdaChunkPrefill
from kestrel.catalog.kda.conv import ShortConv
from kestrel.catalog.kda.gate import KdaGate
from kestrel.catalog.kda.recurrent import KdaRecurrent
from kestrel.ops.kda import chunk_recurrence_varlen, recurrence_varlen
from helpers import compile_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cu(lens):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return cu.to(DEVICE)


def _slots(*s):
    return torch.tensor(s, dtype=torch.int32, device=DEVICE)


def _close(a, b, rtol=1e-4, atol=1e-5, what=""):
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), rtol=rtol, atol=atol, msg=what or None)


def _qkv(T, H, D, gen, form="kimi", scale=1.0):
    q, k, v = (torch.randn(T, H, D, generator=gen).to(DEVICE) for _ in range(3))
    g = realistic_g(T, H, D, form, gen, DEVICE) * scale
    beta = torch.sigmoid(torch.randn(T, H, generator=gen)).to(DEVICE)
    return q, k, v, g.contiguous(), beta


# ------------------------------------------------------------------------------------------------- short conv

def test_conv_state_carries_over_segments_shorter_than_k_minus_1():
    """Feeding a sequence in pieces of 1, 2, 1, 3 tokens (pieces shorter than K-1 = 3) equals one pass."""
    gen = torch.Generator().manual_seed(0)
    H, D, KW = 2, 16, 4
    C = 3 * H * D
    x = torch.randn(7, C, generator=gen).to(DEVICE)
    w = (torch.rand(C, KW, generator=gen) - 0.5).to(DEVICE)
    state0 = torch.randn(3, C, KW - 1, generator=gen).to(DEVICE)

    whole_state = state0.clone()
    with validating(ShortConv):
        whole, _ = ShortConv.raw_call(x, w, whole_state, _cu([7]), _slots(1))
    pieced_state = state0.clone()
    outs, t = [], 0
    for n in (1, 2, 1, 3):
        with validating(ShortConv):
            y, _ = ShortConv.raw_call(x[t:t + n].contiguous(), w, pieced_state, _cu([n]), _slots(1))
        outs.append(y)
        t += n
    _close(torch.cat(outs), whole, what="pieced conv output")
    _close(pieced_state, whole_state, rtol=0, atol=0, what="conv state after pieces")
    # the last K-1 inputs, whatever the piece lengths
    _close(pieced_state[1], x[-(KW - 1):].t(), rtol=0, atol=0)
    _close(pieced_state[0], state0[0], rtol=0, atol=0, what="untouched slot 0")
    _close(pieced_state[2], state0[2], rtol=0, atol=0, what="untouched slot 2")


def test_conv_single_token_shifts_state():
    gen = torch.Generator().manual_seed(1)
    C, KW = 96, 4
    x = torch.randn(2, C, generator=gen).to(DEVICE)
    w = (torch.rand(C, KW, generator=gen) - 0.5).to(DEVICE)
    state = torch.randn(2, C, KW - 1, generator=gen).to(DEVICE)
    old = state.clone()
    with validating(ShortConv):
        y, _ = ShortConv.raw_call(x, w, state, _cu([1, 1]), _slots(1, 0))
    # request 0 lives in slot 1, request 1 in slot 0
    _close(state[1], torch.cat([old[1][:, 1:], x[0][:, None]], 1), rtol=0, atol=0)
    _close(state[0], torch.cat([old[0][:, 1:], x[1][:, None]], 1), rtol=0, atol=0)
    ref0 = torch.nn.functional.silu((torch.cat([old[1], x[0][:, None]], 1) * w).sum(1))
    _close(y[0], ref0, what="decode conv output")


def test_conv_rejects_aliasing_and_shared_slots():
    gen = torch.Generator().manual_seed(2)
    C = 96
    x = torch.randn(3, C, generator=gen).to(DEVICE)
    w = torch.rand(C, 4, generator=gen).to(DEVICE)
    state = torch.randn(4, C, 3, generator=gen).to(DEVICE)
    assert ShortConv.is_valid(x, w, state, _cu([1, 2]), _slots(0, 0))          # two requests, one slot
    assert ShortConv.is_valid(x, w, state, _cu([1, 2]), _slots(0, 4))          # slot out of range
    assert ShortConv.is_valid(x, w, state, _cu([1, 1]), _slots(0, 1))          # cu does not reach T
    assert ShortConv.is_valid(x, w, state, _cu([1, 2]), _slots(0, 1), out=x)   # in-place conv would race
    assert ShortConv.is_valid(x, w, state, _cu([1, 2]), _slots(0, 1)) is None


def _conv_case(lens, C, KW, dtype, gen, x_pad=0):
    """Fresh inputs for a short-conv call: x a row view of wider rows when x_pad > 0, distinct random slots."""
    T = sum(lens)
    x = torch.randn(T, C + x_pad, generator=gen).to(DEVICE, dtype)[:, :C]
    w = ((torch.rand(C, KW, generator=gen) * 2 - 1) * KW ** -0.5).to(DEVICE, dtype)
    cu, slots, pool = batch_layout(lens, None, gen, DEVICE)
    state = torch.randn(pool, C, KW - 1, generator=gen).to(DEVICE, dtype)
    return x, w, state, cu, slots


@pytest.mark.parametrize("dtype,KW", [(torch.float32, 4), (torch.bfloat16, 4), (torch.float32, 3),
                                      (torch.float32, 2)])
def test_conv_planes_equal_the_reference(dtype, KW):
    """parts=3: out [3, T, W] holds channel c in plane c // W, the reference's [T, C] output split in three, with
    contiguous q, k, v planes; segments shorter than K-1 (their taps reach into the state) and segments starting
    inside a conv kernel tile, x a row view, and an out= whose planes lie further apart than T rows. K < 4: the
    kernel's 4-wide window with zero weights in front."""
    gen = torch.Generator().manual_seed(3)
    lens, C = (1, 2, 20, 3, 1, 5), 3 * 32
    x, w, state, cu, slots = _conv_case(lens, C, KW, dtype, gen, x_pad=24)
    state0, ref_state = state.clone(), state.clone()
    ref, _ = ShortConv.reference(x, w, ref_state, cu, slots)
    T = x.shape[0]
    with validating(ShortConv):
        y, _ = ShortConv.raw_call(x, w, state, cu, slots, parts=3)
    assert tuple(y.shape) == (3, T, C // 3) and all(p.is_contiguous() for p in y)
    rtol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for plane, want in zip(y, ref.split(C // 3, dim=-1)):
        _close(plane, want, rtol=rtol, atol=1e-5)
    _close(state, ref_state, rtol=0, atol=0, what="conv state after the planes' call")
    # into a caller's buffer whose planes are T + 5 rows apart; the rows past T stay untouched
    state2 = state0.clone()
    buf = torch.full((3, T + 5, C // 3), 7.0, dtype=dtype, device=DEVICE)
    with validating(ShortConv):
        out, _ = ShortConv.raw_call(x, w, state2, cu, slots, out=buf[:, :T], parts=3)
    _close(out, y, rtol=0, atol=0, what="planes written into out=")
    assert bool((buf[:, T:] == 7.0).all())


def test_conv_planes_and_rows_agree_at_the_longest_segments():
    """One long segment and two back-to-back ones: both layouts give the same values (the conv kernel's rows after
    the first K-1 of a segment, the per-request kernel's first K-1)."""
    gen = torch.Generator().manual_seed(4)
    lens, C = (70, 45), 3 * 64
    x, w, state, cu, slots = _conv_case(lens, C, 4, torch.float32, gen)
    s1, s3 = state.clone(), state.clone()
    with validating(ShortConv):
        rows, _ = ShortConv.raw_call(x, w, s1, cu, slots)
        planes, _ = ShortConv.raw_call(x, w, s3, cu, slots, parts=3)
    _close(planes, rows.view(-1, 3, C // 3).transpose(0, 1), rtol=0, atol=0)
    _close(s1, s3, rtol=0, atol=0)
    ref, _ = ShortConv.reference(x, w, state.clone(), cu, slots)
    _close(rows, ref)


def test_conv_width_past_the_register_window_is_refused():
    from kestrel.kernels.kda.conv import short_conv
    gen = torch.Generator().manual_seed(5)
    x, w, state, cu, slots = _conv_case((3,), 96, 5, torch.float32, gen)
    assert "conv width K=5" in ShortConv.is_valid(x, w, state, cu, slots)
    with pytest.raises(ValueError, match="K=5"):
        short_conv(x, w, state, cu, slots)
    assert "parts=5" in ShortConv.is_valid(*_conv_case((3,), 96, 4, torch.float32, gen), parts=5)


class _Launches:
    """Stands in for a kernel: records each launch (grid, positional and keyword arguments), runs nothing."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.kernel, grid, args, kw))


def _specialization(kernel, args, kw):
    """What Triton compiles a launch for: the constexprs and warps, each specialized integer's ==1 / %16 class and
    each tensor's dtype (T, B, plane offsets: do_not_specialize, so not part of it)."""
    import inspect
    names = list(inspect.signature(kernel.fn).parameters)
    # a JITFunction keeps the names it was declared with, the interpreter's stand-in its decorator kwargs
    free = getattr(kernel, "do_not_specialize", None)
    free = set(free if free is not None else kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name, a in zip(names, args):
        if torch.is_tensor(a):
            key.append((name, a.dtype))
        elif name not in free:
            key.append((name, "1" if a == 1 else "%16" if a % 16 == 0 else "int"))
    return tuple(key) + tuple(sorted(kw.items()))


def test_conv_launches_do_not_follow_tokens_or_requests(monkeypatch):
    """No JIT on the serving path: at one model width and layout, steps of any token and request count (decode,
    verify, prefill, chunked mixes) launch the same compiled variants; only unspecialized arguments change."""
    from kestrel.kernels.kda import conv as K
    kernels = {name: getattr(K, name) for name in ("_short_conv_fwd_kernel", "_short_conv_state_kernel")}
    gen = torch.Generator().manual_seed(6)
    C, pad = 3 * 4096, 288                       # Kimi Linear's widths, x a view of the joined projection
    for parts in (1, 3):
        seen = set()
        for lens in ((1,), (1,) * 17, (4,) * 64, (8192,), (2048,) * 4, (1, 1, 1000) + (1,) * 16 + (3,), (33,)):
            calls = []
            for name, k in kernels.items():
                monkeypatch.setattr(K, name, _Launches(k, calls))
            T = sum(lens)
            x = torch.empty(T, C + pad, dtype=torch.bfloat16)[:, :C]
            w = torch.empty(C, 4, dtype=torch.bfloat16)
            cu, slots, pool = batch_layout(lens, None, gen, "cpu")
            K.short_conv(x, w, torch.empty(pool, C, 3, dtype=torch.bfloat16), cu, slots, parts=parts)
            assert [k for k, *_ in calls] == list(kernels.values())
            seen.add(tuple(_specialization(k, args, kw) for k, _, args, kw in calls))
        assert len(seen) == 1, (parts, seen)


_COMPILE = """
import inspect, os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kestrel.kernels.kda import conv as K

calls = []
class Launches:
    def __init__(self, kernel): self.kernel = kernel
    def __getitem__(self, grid): return lambda *a, **kw: calls.append((self.kernel, a, kw))
fwd, state = K._short_conv_fwd_kernel, K._short_conv_state_kernel
K._short_conv_fwd_kernel, K._short_conv_state_kernel = Launches(fwd), Launches(state)
# the real widths, x a view of the joined projection: Kimi Linear, K3 tp1, K3 tp8 (row stride 6284: 4-aligned)
for C, row, parts in ((12288, 12576, 1), (12288, 12576, 3), (36864, 49376, 3), (4608, 6284, 3), (12288, 12288, 3)):
    x = torch.empty(100, row, dtype=torch.bfloat16)[:, :C]
    cu = torch.tensor([0, 1, 100], dtype=torch.int32)
    K.short_conv(x, torch.empty(C, 4, dtype=torch.bfloat16), torch.empty(3, C, 3, dtype=torch.bfloat16), cu,
                 torch.tensor([0, 2], dtype=torch.int32), parts=parts)
from triton.backends.nvidia.compiler import get_ptxas
ptxas = get_ptxas(90).path              # the ptxas this Triton compiles sm_90 with
done = set()
for kernel, args, kw in calls:
    names = list(inspect.signature(kernel.fn).parameters)
    free = set(kernel.do_not_specialize or ())
    sig, attrs, const = {}, {}, {}
    for i, (name, a) in enumerate(zip(names, args)):
        if torch.is_tensor(a):
            sig[name] = "*" + {torch.bfloat16: "bf16", torch.int32: "i32"}[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a == 1 and name not in free:
            sig[name] = "constexpr"; const[name] = 1
        else:
            sig[name] = "i32"
            if a % 16 == 0 and name not in free:
                attrs[(i,)] = [["tt.divisibility", 16]]
    warps = kw.pop("num_warps")
    for name, v in kw.items():
        sig[name] = "constexpr"; const[name] = v
    key = (kernel.fn.__name__, tuple(sorted(sig.items())), tuple(sorted(attrs)), tuple(sorted(const.items())), warps)
    if key in done:
        continue
    done.add(key)
    k = triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps))
    d = tempfile.mkdtemp()
    open(os.path.join(d, "k.ptx"), "w").write(k.asm["ptx"])
    info = subprocess.run([ptxas, "-v", "-arch=sm_90a", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.cubin")],
                          capture_output=True, text=True).stderr
    assert " 0 bytes spill stores" in info, info
    regs = re.search(r"Used (\\d+) registers", info)
    print("compiled", kernel.fn.__name__, sorted(const.items()), "warps", warps, "regs", regs and regs.group(1))
print("cubins", len(done))
"""


def test_short_conv_compiles_for_the_h200():
    """The interpreter runs the kernels as Python; this compiles them for sm_90 as short_conv launches them at the
    real widths (no GPU needed; a process without TRITON_INTERPRET), with no register spills."""
    assert "cubins" in compile_for_sm90(_COMPILE, fp_fusion=True)


# ------------------------------------------------------------------------------------------------------- gate

def test_gate_softplus_tail_precision():
    """Very negative f + dt_bias (softplus ~ e^x) keeps full relative precision; very positive is linear."""
    H, D = 1, 16
    f = torch.linspace(-30, 30, 32).view(2, 16).to(DEVICE)
    A_log = torch.zeros(H, device=DEVICE)
    dt_bias = torch.zeros(H * D, device=DEVICE)
    b = torch.zeros(2, H, device=DEVICE)
    with validating(KdaGate):
        g, beta = KdaGate.raw_call(f, A_log, dt_bias, b)
    ref = -torch.nn.functional.softplus(f.double()).view(2, 1, 16)
    _close(g, ref.float(), rtol=1e-5, atol=0)
    _close(beta, torch.full((2, 1), 0.5), rtol=0, atol=0)


# ------------------------------------------------------------------------------------- recurrent and chunked

def test_chunk_reference_matches_naive_loop():
    """The torch chunked CPU path equals the token loop to ~1e-5 relative (outputs and states), mixed lengths."""
    gen = torch.Generator().manual_seed(3)
    spec = dict(lens=(1, 31, 33, 100), H=2, D=16, gate="kimi", dtype=torch.float32)
    x = make_kda_inputs(spec, DEVICE, gen)
    y = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
    o1, s1 = chunk_recurrence_varlen(**x, chunk_size=32)
    o2, s2 = recurrence_varlen(**y)
    scale = o2.abs().max()
    _close(o1 / scale, o2 / scale, rtol=1e-5, atol=1e-6, what="chunk_reference o")
    _close(s1, s2, rtol=1e-5, atol=1e-6, what="chunk_reference state")


def test_prefill_then_decode_equals_naive_over_concatenation():
    """Chunk prefill of 70 tokens (a full and a partial chunk), then two verify steps of 3 and 1 tokens through
    the recurrent kernel, equals the naive recurrence over all 74 tokens: outputs and final state."""
    gen = torch.Generator().manual_seed(4)
    H, D = 2, 16
    q, k, v, g, beta = _qkv(74, H, D, gen)
    state0 = (torch.randn(3, H, D, D, generator=gen) * 0.3).to(DEVICE)
    slot = _slots(2)

    state = state0.clone()
    with validating(KdaChunkPrefill):
        o_pre, _ = KdaChunkPrefill.raw_call(q[:70], k[:70], v[:70], g[:70], beta[:70], state, _cu([70]), slot)
    outs = [o_pre]
    for a, b in ((70, 73), (73, 74)):
        with validating(KdaRecurrent):
            o, _ = KdaRecurrent.raw_call(q[a:b], k[a:b], v[a:b], g[a:b].contiguous(), beta[a:b].contiguous(),
                                         state, _cu([b - a]), slot)
        outs.append(o)
    ref_state = state0.clone()
    o_ref, _ = recurrence_varlen(q, k, v, g, beta, ref_state, _cu([74]), slot)
    _close(torch.cat(outs), o_ref, what="prefill + decode outputs")
    _close(state, ref_state, rtol=1e-4, atol=1e-5, what="state after prefill + decode")
    _close(state[:2], state0[:2], rtol=0, atol=0, what="other slots")


@pytest.mark.parametrize("entry,lens", [(KdaChunkPrefill, (23, 70)), (KdaRecurrent, (3, 1))])
def test_two_requests_equal_each_alone(entry, lens):
    gen = torch.Generator().manual_seed(5)
    H, D = 2, 16
    T = sum(lens)
    q, k, v, g, beta = _qkv(T, H, D, gen, form="k3")
    state0 = (torch.randn(4, H, D, D, generator=gen) * 0.3).to(DEVICE)
    both = state0.clone()
    with validating(entry):
        o_both, _ = entry.raw_call(q, k, v, g, beta, both, _cu(lens), _slots(3, 0))
    alone = state0.clone()
    outs = []
    for (a, b), s in zip(((0, lens[0]), (lens[0], T)), (3, 0)):
        with validating(entry):
            o, _ = entry.raw_call(q[a:b], k[a:b], v[a:b], g[a:b].contiguous(), beta[a:b].contiguous(), alone,
                                  _cu([b - a]), _slots(s))
        outs.append(o)
    _close(o_both, torch.cat(outs), rtol=1e-5, atol=1e-6, what="batched vs alone outputs")
    _close(both, alone, rtol=1e-5, atol=1e-6, what="batched vs alone states")


@pytest.mark.parametrize("entry,lens", [(KdaChunkPrefill, (5, 40)), (KdaRecurrent, (2, 1))])
def test_slot_isolation(entry, lens):
    """Only the batch's slots change; the rest of the pool keeps its exact bytes."""
    gen = torch.Generator().manual_seed(6)
    H, D = 2, 16
    q, k, v, g, beta = _qkv(sum(lens), H, D, gen)
    state = (torch.randn(6, H, D, D, generator=gen) * 0.3).to(DEVICE)
    old = state.clone()
    with validating(entry):
        entry.raw_call(q, k, v, g, beta, state, _cu(lens), _slots(4, 1))
    for s in (0, 2, 3, 5):
        assert torch.equal(state[s], old[s]), f"slot {s} was written"
    for s in (4, 1):
        assert not torch.equal(state[s], old[s]), f"slot {s} was not updated"


def test_chunk_strong_decay_stays_exact():
    """Decays of up to ~-30 per token (cumulative -1000s within a chunk) overflow any factorized exp(G_t)exp(-G_s);
    the kernel's exponents stay <= 0 and match the naive loop."""
    gen = torch.Generator().manual_seed(7)
    H, D = 2, 16
    q, k, v, g, beta = _qkv(80, H, D, gen)
    g = -torch.rand(80, H, D, generator=gen).to(DEVICE) * 30.0
    g[:, :, :4] = -1e-3                      # a few slow channels carry information across the chunk
    state0 = (torch.randn(1, H, D, D, generator=gen) * 0.3).to(DEVICE)
    s1, s2 = state0.clone(), state0.clone()
    with validating(KdaChunkPrefill):
        o1, _ = KdaChunkPrefill.raw_call(q, k, v, g, beta, s1, _cu([80]), _slots(0))
    o2, _ = recurrence_varlen(q, k, v, g, beta, s2, _cu([80]), _slots(0))
    assert torch.isfinite(o1).all() and torch.isfinite(s1).all()
    _close(o1, o2, what="strong-decay outputs")
    _close(s1, s2, rtol=1e-4, atol=1e-5, what="strong-decay state")


def test_chunk_accepts_fused_qkv_views_and_out():
    """q, k, v as strided views of one [T, 3*H*D] conv output, writing into a caller's `out`."""
    gen = torch.Generator().manual_seed(8)
    H, D, T = 2, 16, 20
    qkv = torch.randn(T, 3 * H * D, generator=gen).to(DEVICE)
    q, k, v = (qkv[:, i * H * D:(i + 1) * H * D].view(T, H, D) for i in range(3))
    g = realistic_g(T, H, D, "kimi", gen, DEVICE)
    beta = torch.sigmoid(torch.randn(T, H, generator=gen)).to(DEVICE)
    s1 = (torch.randn(2, H, D, D, generator=gen) * 0.3).to(DEVICE)
    s2 = s1.clone()
    out = torch.empty(T, H, D, device=DEVICE)
    with validating(KdaChunkPrefill):
        o, _ = KdaChunkPrefill.raw_call(q, k, v, g, beta, s1, _cu([T]), _slots(1), out=out)
    assert o is out
    o_ref, _ = recurrence_varlen(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, s2, _cu([T]), _slots(1))
    _close(out, o_ref)
    _close(s1, s2, rtol=1e-4, atol=1e-5)
    assert KdaChunkPrefill.is_valid(q, k, v, g, beta, s1, _cu([T]), _slots(1), out=qkv[:, :H * D].view(T, H, D))


def test_batch_layout_helper_leaves_free_slots():
    cu, slots, pool = batch_layout((3, 0, 2), None, torch.Generator().manual_seed(0), "cpu")
    assert cu.tolist() == [0, 3, 3, 5] and pool == 6 and len(set(slots.tolist())) == 3
