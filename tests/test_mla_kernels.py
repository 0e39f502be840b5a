"""MLA kernels beyond the generic cell driver: the absorbed form equals the expanded (W_UK / W_UV) form, split-K
and page scattering do not change the answer, and cache-write + decode equals plain attention. All in fp32 on tiny
widths (the Triton interpreter on CPUs; compiled on GPUs)."""

import pytest
import torch

from kestrel.catalog._op import InvalidInput, assert_close, validating
from kestrel.catalog.attention._mla_common import build_paged_cache, gather_rows, latent_rows
from kestrel.catalog.attention.mla_cache_write import MlaCacheWrite
from kestrel.catalog.attention.mla_decode import MlaDecode
from kestrel.catalog.attention.mla_prefill import MlaPrefill

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
L, R, DN, DV = 32, 16, 32, 32          # latent, rope, qk_nope, v head dims (tiny stand-ins for 512, 64, 128, 128)
SCALE = (DN + R) ** -0.5


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _decode_batch(lens, tokens_per_req, heads, page_size, seed, dtype=torch.float32):
    """Paged cache for `lens`, plus the T query tokens' req_idx / kv_lens (the last `tokens_per_req` positions of
    each request, in shuffled request order)."""
    g = _gen(seed)
    kv_cache, bt = build_paged_cache(lens, page_size, L, R, dtype, DEVICE, g)
    order = torch.randperm(len(lens), generator=g).tolist()
    req = [b for b in order for _ in range(tokens_per_req)]
    kvl = [lens[b] - tokens_per_req + 1 + j for b in order for j in range(tokens_per_req)]
    q = torch.randn(len(req), heads, L + R, generator=g).to(DEVICE, dtype)
    return dict(q=q, kv_cache=kv_cache, block_tables=bt,
                req_idx=torch.tensor(req, dtype=torch.int32, device=DEVICE),
                kv_lens=torch.tensor(kvl, dtype=torch.int32, device=DEVICE), scale=SCALE, kv_lora_rank=L)


def _decode(inputs, num_splits=1):
    with validating(MlaDecode):
        return MlaDecode.raw_call(**inputs, num_splits=num_splits)


def test_absorbed_decode_equals_expanded_attention():
    """softmax(scale (q_nope.k_nope + q_pe.k_pe)) @ v with k_nope = c W_UK, v = c W_UV per head (the expanded form,
    in plain torch and through the prefill kernel) == W_UV applied to the absorbed decode's latent output."""
    H = 4
    g = _gen(1)
    inp = _decode_batch([1, 17, 40, 33], tokens_per_req=1, heads=H, page_size=16, seed=2)
    inp_v = _decode_batch([6, 35], tokens_per_req=3, heads=H, page_size=16, seed=3)
    for batch in (inp, inp_v):
        T = batch["q"].shape[0]
        w_uk = (torch.randn(H, L, DN, generator=g) / L**0.5).to(DEVICE)
        w_uv = (torch.randn(H, L, DV, generator=g) / L**0.5).to(DEVICE)
        q_nope = torch.randn(T, H, DN, generator=g).to(DEVICE)
        q_pe = torch.randn(T, H, R, generator=g).to(DEVICE)
        q_abs = torch.cat([torch.einsum("thd,hld->thl", q_nope, w_uk), q_pe], dim=-1)
        absorbed, lse = _decode({**batch, "q": q_abs}, num_splits=2)
        absorbed = torch.einsum("thl,hld->thd", absorbed, w_uv)

        # Expanded form, plain torch, and the same attention as varlen prefill (one 1-token "chunk" per query).
        exp_out = torch.empty(T, H, DV, device=DEVICE)
        exp_lse = torch.empty(T, H, device=DEVICE)
        qs, ks, vs, cu_k = [], [], [], [0]
        for t, (r, n) in enumerate(zip(batch["req_idx"].tolist(), batch["kv_lens"].tolist())):
            rows = gather_rows(batch["kv_cache"], batch["block_tables"], r, n).float()
            c, kpe = rows[:, :L], rows[:, L:]
            k_nope = torch.einsum("nl,hld->hnd", c, w_uk)
            v = torch.einsum("nl,hld->hnd", c, w_uv)
            s = (torch.einsum("hd,hnd->hn", q_nope[t], k_nope) + q_pe[t] @ kpe.T) * SCALE
            exp_lse[t] = torch.logsumexp(s, -1)
            exp_out[t] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v)
            qs.append(torch.cat([q_nope[t], q_pe[t]], -1)[None])
            ks.append(torch.cat([k_nope, kpe[None].expand(H, n, R)], -1).transpose(0, 1))
            vs.append(v.transpose(0, 1))
            cu_k.append(cu_k[-1] + n)
        assert_close(absorbed, exp_out, rtol=1e-4, atol=1e-5, what="absorbed vs expanded out")
        assert_close(lse, exp_lse, rtol=1e-5, atol=1e-5, what="absorbed vs expanded lse")

        with validating(MlaPrefill):
            pre = MlaPrefill.raw_call(torch.cat(qs), torch.cat(ks).contiguous(), torch.cat(vs).contiguous(),
                                      torch.arange(T + 1, dtype=torch.int32, device=DEVICE),
                                      torch.tensor(cu_k, dtype=torch.int32, device=DEVICE), SCALE)
        assert_close(pre, exp_out, rtol=1e-4, atol=1e-5, what="prefill kernel vs expanded out")


@pytest.mark.parametrize("tokens_per_req", [1, 4])
def test_split_k_gives_the_same_output(tokens_per_req):
    lens = [4, 16, 45, 70] if tokens_per_req == 1 else [4, 50]
    inp = _decode_batch(lens, tokens_per_req=tokens_per_req, heads=3, page_size=16, seed=4)
    base_o, base_lse = _decode(inp, 1)
    for splits in (2, 7):
        o, lse = _decode(inp, splits)
        assert_close(o, base_o, rtol=1e-5, atol=1e-6, what=f"{splits} splits out")
        assert_close(lse, base_lse, rtol=1e-6, atol=1e-6, what=f"{splits} splits lse")
    ref_o, ref_lse = MlaDecode.reference(**inp)
    assert_close(base_o, ref_o, rtol=1e-4, atol=1e-5, what="1 split vs reference")


@pytest.mark.parametrize("page_size", [16, 64])
def test_scattered_pages_match_contiguous(page_size):
    """The same logical rows laid out in pages 0, 1, 2, ... and in shuffled, non-contiguous pages give the same
    result bit for bit (the kernel's arithmetic does not depend on where a page lives)."""
    g = _gen(5)
    lens = [1, page_size, page_size + 3, 2 * page_size + 9]
    H = 4
    c, pe = latent_rows((sum(lens),), L, R, g, torch.device("cpu"))
    rows = torch.cat([c, pe], -1).to(DEVICE)
    need = [-(-n // page_size) for n in lens]
    n_pages = sum(need) + 5

    def layout(page_ids):
        cache = torch.full((n_pages, page_size, L + R), float("nan"), device=DEVICE)   # unused slots: never read
        bt = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
        at, off = 0, 0
        for b, n in enumerate(lens):
            ids = page_ids[at:at + need[b]]
            bt[b, :need[b]] = torch.tensor(ids, dtype=torch.int32)
            for p in range(n):
                cache[ids[p // page_size], p % page_size] = rows[off + p]
            at, off = at + need[b], off + n
        return cache, bt.to(DEVICE)

    contiguous = layout(list(range(n_pages)))
    scattered = layout(torch.randperm(n_pages, generator=g).tolist())
    q = torch.randn(len(lens), H, L + R, generator=g).to(DEVICE)
    common = dict(q=q, req_idx=torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEVICE),
                  kv_lens=torch.tensor([lens[2], lens[0], lens[3], lens[1]], dtype=torch.int32, device=DEVICE),
                  scale=SCALE, kv_lora_rank=L)
    for splits in (1, 3):
        a = _decode({**common, "kv_cache": contiguous[0], "block_tables": contiguous[1]}, splits)
        b = _decode({**common, "kv_cache": scattered[0], "block_tables": scattered[1]}, splits)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert torch.isfinite(a[0]).all()


def test_cache_write_then_decode_equals_plain_attention():
    """Prefill chunk writes, then a decode step writes one more token per request (with a padding slot), then decode
    over the cache == softmax attention over the written latents themselves. The cache starts as NaN, so any read
    of an unwritten slot would show."""
    g = _gen(6)
    page_size, H = 16, 4
    prompt = [7, 16, 30]
    lens = [n + 1 for n in prompt]
    need = [-(-n // page_size) for n in lens]
    n_pages = sum(need) + 2
    perm = torch.randperm(n_pages, generator=g)
    bt = torch.full((3, max(need)), -1, dtype=torch.int32)
    at = 0
    for b, k in enumerate(need):
        bt[b, :k] = perm[at:at + k].to(torch.int32)
        at += k
    bt = bt.to(DEVICE)
    cache = torch.full((n_pages, page_size, L + R), float("nan"), device=DEVICE)
    lat = [latent_rows((n,), L, R, g, torch.device("cpu")) for n in lens]

    def write(tokens):                  # tokens: list of (request, position)
        req = torch.tensor([r for r, _ in tokens], dtype=torch.int32, device=DEVICE)
        pos = torch.tensor([p for _, p in tokens], dtype=torch.int64, device=DEVICE)
        c = torch.stack([lat[r][0][max(p, 0)] for r, p in tokens]).to(DEVICE)
        pe = torch.stack([lat[r][1][max(p, 0)] for r, p in tokens]).to(DEVICE)
        with validating(MlaCacheWrite):
            out = MlaCacheWrite.raw_call(c, pe, cache, bt, req, pos)
        assert out is cache

    write([(b, p) for b, n in enumerate(prompt) for p in range(n)])          # prefill chunk
    write([(1, prompt[1]), (0, -1), (2, prompt[2]), (0, prompt[0])])         # decode step, one padding slot
    q = torch.randn(3, H, L + R, generator=g).to(DEVICE)
    o, lse = _decode(dict(q=q, kv_cache=cache, block_tables=bt,
                          req_idx=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
                          kv_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                          scale=SCALE, kv_lora_rank=L), num_splits=2)
    for b in range(3):
        kv = torch.cat(lat[b], -1).to(DEVICE)
        s = (q[b] @ kv.T) * SCALE
        assert_close(o[b], torch.softmax(s, -1) @ kv[:, :L], rtol=1e-4, atol=1e-5, what=f"request {b} out")
        assert_close(lse[b], torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5, what=f"request {b} lse")


def test_chunked_prefill_equals_rows_of_full_prefill():
    """A chunk over earlier context (bottom-right causal) answers the same as the matching rows of one prefill over
    the whole prompt."""
    g = _gen(7)
    H, n, chunk = 2, 45, 13
    q = torch.randn(n, H, DN + R, generator=g).to(DEVICE)
    k = torch.randn(n, H, DN + R, generator=g).to(DEVICE)
    v = torch.randn(n, H, DV, generator=g).to(DEVICE)
    full = MlaPrefill.raw_call(q, k, v, torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                               torch.tensor([0, n], dtype=torch.int32, device=DEVICE), SCALE)
    part = MlaPrefill.raw_call(q[n - chunk:].contiguous(), k, v,
                               torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE),
                               torch.tensor([0, n], dtype=torch.int32, device=DEVICE), SCALE)
    assert_close(part, full[n - chunk:], rtol=1e-5, atol=1e-6, what="chunk vs full prefill rows")


def test_is_valid_refuses_silently_wrong_inputs():
    inp = _decode_batch([5, 20], tokens_per_req=1, heads=2, page_size=16, seed=8)
    assert MlaDecode.is_valid(**inp) is None
    bad_lens = inp["kv_lens"].clone()
    bad_lens[0] = 33                                            # past the request's pages
    assert MlaDecode.is_valid(**{**inp, "kv_lens": bad_lens})
    assert MlaDecode.is_valid(**{**inp, "kv_lens": inp["kv_lens"] * 0})
    assert MlaDecode.is_valid(**{**inp, "q": inp["q"][..., :-1]})
    assert MlaDecode.is_valid(**{**inp, "q": inp["q"].double()})
    with pytest.raises(InvalidInput), validating(MlaDecode):
        MlaDecode.raw_call(**{**inp, "req_idx": inp["req_idx"] + 5})

    lat = torch.randn(2, L, device=DEVICE)
    pe = torch.randn(2, R, device=DEVICE)
    dup = dict(latent=lat, k_pe=pe, kv_cache=inp["kv_cache"], block_tables=inp["block_tables"],
               req_idx=torch.tensor([1, 1], dtype=torch.int32, device=DEVICE),
               positions=torch.tensor([3, 3], dtype=torch.int64, device=DEVICE))
    assert "same cache slot" in MlaCacheWrite.is_valid(**dup)

    q = torch.randn(10, 2, DN + R, device=DEVICE)
    kv = torch.randn(6, 2, DN + R, device=DEVICE)
    cu_q = torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)
    assert "fewer keys" in MlaPrefill.is_valid(q, kv, kv[..., :DV], cu_q, cu_k, SCALE)
    # FP8 q . k needs one 32-deep MMA at least (sm_90): a 24-wide head is refused, not left to fail compiling
    from kestrel.catalog.attention.mla_prefill_fp8 import MlaPrefillFp8
    one = torch.ones(1, device=DEVICE)
    q8 = q[..., :32].to(torch.float8_e4m3fn)
    assert MlaPrefillFp8.is_valid(q8, q8, q8, one, one, one, cu_q, cu_q, SCALE) is None
    q8 = q8[..., :24]
    assert "at least 32" in MlaPrefillFp8.is_valid(q8, q8, q8, one, one, one, cu_q, cu_q, SCALE)


def test_pick_num_splits():
    from kestrel.kernels.attention.mla_decode import pick_num_splits
    assert pick_num_splits(128, 64, 8192) == 1                  # 512 head tiles: already several waves
    assert pick_num_splits(1, 64, 131072) == 66                 # 4 head tiles -> about two waves of splits
    assert pick_num_splits(1, 64, 1500) == 2                    # never a split shorter than 1024 positions
    assert pick_num_splits(1, 8, 10**7) == 256                  # capped


def _cuda_scalar_div(x: torch.Tensor, c: float) -> torch.Tensor:
    """What torch on CUDA computes for `x / c` with a Python scalar c: x times c's fp32 reciprocal."""
    return x * (torch.tensor(1.0) / torch.tensor(c))


def _ieee(num: torch.Tensor, den) -> torch.Tensor:
    """The correctly rounded fp32 quotient (fp64 division of fp32 values, rounded once, is exact rounding)."""
    return (num.double() / (den.double() if isinstance(den, torch.Tensor) else den)).float()


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def _nvfp4_tie_rows(n: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 latent rows [n, width] (two or more NVFP4 blocks) on which a reciprocal-multiply quantize diverges from
    the IEEE one: the row amax a (in block 0) has a * fp32(1/2688) != a / 2688, and block 1's amax b puts
    b / 6 / s2 next to an e4m3 rounding midpoint, where b * fp32(1/6) (one ulp off b / 6) rounds the block scale
    to the other neighbour. Found by search over fp32 neighbours; the other channels are random below b."""
    codes = torch.arange(8, 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn).float()   # finite, > 0
    rows = []
    while len(rows) < n:
        a = (torch.rand((), generator=gen) * 8 + 0.5).reshape(1)
        if torch.equal(_cuda_scalar_div(a, 2688.0), _ieee(a, 2688.0)):
            continue
        s2 = _ieee(a, 2688.0)
        i = int(torch.randint(20, 90, (), generator=gen))
        mid = (codes[i] + codes[i + 1]) / 2                                # exact in fp32
        b0 = (mid.double() * 6 * s2.double()).float().view(torch.int32)
        b = (b0 + torch.arange(-64, 65, dtype=torch.int32)).view(torch.float32)
        flips = _e4m3(_ieee(_ieee(b, 6.0), s2)) != _e4m3(_ieee(_cuda_scalar_div(b, 6.0), s2))
        if not flips.any():
            continue
        bb = float(b[flips][0])
        row = (torch.rand(width, generator=gen) * 2 - 1) * bb
        row[int(torch.randint(0, 16, (), generator=gen))] = float(a) * (1 if len(rows) % 2 else -1)
        row[16 + int(torch.randint(0, 16, (), generator=gen))] = bb
        rows.append(row)
    return torch.stack(rows)


def test_nvfp4_write_is_ieee_where_a_reciprocal_multiply_is_not():
    """Issue 10 item 6: on the H200 the NVFP4 cache write kernel and its reference disagreed on byte 0 of a few
    rows, because torch on CUDA divides by a Python scalar as a multiply by the rounded reciprocal while the kernel
    divides with div_rn (the CPU reference divides exactly, so CPU cells passed). The reference now divides by
    same-device tensors (quant.codes.div_by). Rows built where the two disagree, both in s2 (byte 0..3) and in an
    e4m3 block scale at a rounding tie: the reference equals an independent fp64 computation, the old CUDA
    arithmetic would not, and the kernel (interpreted on a CPU, compiled on a GPU) writes the reference's bytes."""
    from kestrel.catalog.attention.mla_cache_write_nvfp4 import MlaCacheWriteNvfp4
    from kestrel.quant.kv_cache import KvPageFormat

    T, ps = 24, 16
    lat = _nvfp4_tie_rows(T, L, torch.Generator().manual_seed(5))
    fmt = KvPageFormat("nvfp4", L, R)
    pe = torch.randn(T, R, generator=torch.Generator().manual_seed(6))
    rows = fmt.encode(lat.to(DEVICE), pe.to(DEVICE)).cpu()
    v = fmt.views(rows)
    amax = lat.abs().amax(-1, keepdim=True)
    s2 = _ieee(amax, 2688.0)
    bamax = lat.abs().unflatten(-1, (2, 16)).amax(-1)
    assert torch.equal(v["scale"], s2)
    assert torch.equal(v["block_scale"].float(), _e4m3(_ieee(_ieee(bamax, 6.0), s2)))
    # the old reference's arithmetic on CUDA gives other bytes on every row: s2 and block 1's scale
    assert (_cuda_scalar_div(amax, 2688.0) != s2).all()
    assert (_e4m3(_ieee(_cuda_scalar_div(bamax[:, 1:], 6.0), s2)) != v["block_scale"][:, 1:].float()).all()
    if DEVICE.type == "cuda":
        assert torch.equal(rows, fmt.encode(lat, pe))                   # the reference is device-independent

    pages = torch.randperm(4, generator=torch.Generator().manual_seed(7)).to(torch.int32)
    block_tables = torch.stack([pages[:2], pages[2:]]).to(DEVICE)
    req = torch.tensor([t % 2 for t in range(T)], dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([t // 2 for t in range(T)], dtype=torch.int64, device=DEVICE)
    inputs = dict(latent=lat.to(DEVICE), k_pe=pe.to(DEVICE), block_tables=block_tables, req_idx=req, positions=pos)
    cache = fmt.allocate(4, ps, DEVICE)
    with validating(MlaCacheWriteNvfp4):
        out = MlaCacheWriteNvfp4.raw_call(kv_cache=cache.clone(), **inputs)
    ref = MlaCacheWriteNvfp4.reference(kv_cache=cache.clone(), **inputs)
    assert torch.equal(out.cpu(), ref.cpu())
    assert torch.equal(ref.cpu()[block_tables.cpu().long()[req.cpu().long(), pos.cpu() // ps], pos.cpu() % ps], rows)


# sm_90 shared memory of each tile mla_decode may pick on a GPU at the real widths (L 512, R 64), by page kind and
# query bytes: (kind, q bytes, BLOCK_H, BLOCK_N, warps, stages) -> Triton 3.6 `metadata.shared`, measured by
# compiling the kernel for sm_90 (a GPUTarget, no GPU needed). The limit is 227 KiB = 232448 bytes a CTA; the
# H200 refused FP8 / NVFP4 pages at 16 x 128 (364544 / 334336). A new tile choice needs its measurement here.
SM90_DECODE_SMEM = {
    ("bf16", 2, 16, 128, 4, 2): 169984, ("bf16", 2, 32, 64, 8, 3): 115200, ("bf16", 2, 64, 64, 8, 2): 221184,
    ("fp8", 2, 16, 64, 4, 2): 191488, ("fp8", 2, 32, 64, 8, 3): 210688, ("fp8", 2, 64, 64, 8, 2): 189440,
    ("nvfp4", 2, 16, 64, 4, 2): 176384, ("nvfp4", 2, 32, 64, 8, 3): 195840, ("nvfp4", 2, 64, 64, 8, 2): 174336,
    ("bf16", 4, 16, 32, 4, 2): 112704, ("bf16", 4, 32, 32, 8, 3): 151936,
    ("fp8", 4, 16, 32, 4, 2): 131584, ("fp8", 4, 32, 32, 8, 3): 168832,
    ("nvfp4", 4, 16, 32, 4, 2): 124032, ("nvfp4", 4, 32, 32, 8, 3): 161408,
}


def test_decode_tiles_on_an_h200_fit_its_shared_memory(monkeypatch):
    """Every real-width decode cell's shape (bf16, FP8, NVFP4 pages; bf16 and fp32 queries) gets a tile whose
    measured sm_90 shared memory fits, on a 132-SM H200."""
    import kestrel.kernels.attention.mla_decode as md
    from kestrel.catalog.attention.mla_decode_fp8 import MlaDecodeFp8
    from kestrel.catalog.attention.mla_decode_nvfp4 import MlaDecodeNvfp4
    monkeypatch.setattr(md, "_sm_count", lambda index: 132)
    assert max(SM90_DECODE_SMEM.values()) <= 232448
    seen = set()
    for entry, kind in ((MlaDecode, "bf16"), (MlaDecodeFp8, "fp8"), (MlaDecodeNvfp4, "nvfp4")):
        for cell in entry.CELLS:
            s = cell.spec
            if s["kv_lora_rank"] != 512:
                continue
            T = int(s.get("batch", 1)) * int(s.get("tokens_per_req", 1))
            for dtype in (torch.bfloat16, torch.float32):
                c = md._config(torch.device("cuda", 0), T, s["heads"], int(s["num_splits"]), dtype, kind != "bf16")
                key = (kind, dtype.itemsize, c["BLOCK_H"], c["BLOCK_N"], c["num_warps"], c["num_stages"])
                assert key in SM90_DECODE_SMEM, f"{entry.__name__} {cell.why}: tile {key} never measured"
                seen.add(key)
    assert ("fp8", 2, 16, 64, 4, 2) in seen and ("nvfp4", 2, 16, 64, 4, 2) in seen      # the H200's failing shapes
