"""runtime/precompile.py on a machine without a GPU: Triton compiles for GPUTarget("cuda", 90, 32) here, so a dry run
under a stand-in driver (the H200's target, no launcher) shows that the workers fill the disk cache the real compile
then reads, that nothing is launched, and that a variant the workers cannot compile is left to the real run."""
from __future__ import annotations

import json
import textwrap

from helpers import compile_for_sm90

# the spawned workers import this file again as their main module: only definitions run there
PRELUDE = r"""
import json, os, tempfile, torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class StandIn:          # the H200's target; launching anything fails (a dry run must not launch)
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")

def setup():
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kestrel-precompile-")
    driver.set_active(StandIn())

from kestrel.runtime import precompile as P
P._enabled = lambda device: None           # CUDA is what it checks for; the stand-in plays the GPU
from kestrel.kernels.moe import router as R
H = 2304
x, w, out = torch.randn(1, H).bfloat16(), torch.randn(64, H).bfloat16(), torch.randn(1, 64)

def router(bk, warps, warmup=False):
    args = (x, w, out, 1, 64, H, x.stride(0), w.stride(0), out.stride(0))
    meta = dict(BT=1, BE=2, BK=bk, EVEN_K=H % bk == 0, num_warps=warps)
    if warmup:
        return R._router_logits_kernel.run(*args, **meta, grid=(1,), warmup=True)
    R._router_logits_kernel[(1,)](*args, **meta)

def files():
    return sum(len(f) for _, _, f in os.walk(os.environ["TRITON_CACHE_DIR"]))
"""


def run(body: str, tmp_path) -> dict:
    """`body` after PRELUDE, from a file (Triton reads a kernel's source from its file), run through runpy so that the
    spawned workers do not import it again as their main module."""
    script = tmp_path / "probe.py"
    script.write_text(PRELUDE + "\nif __name__ == '__main__':\n    setup()\n" + textwrap.indent(body, "    "))
    out = compile_for_sm90(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    return json.loads(out.strip().splitlines()[-1])


def test_workers_fill_the_cache_that_the_real_compile_reads(tmp_path):
    r = run(r"""
empty, before = torch.empty, out.clone()
with P.ahead(torch.device("cuda"), workers=2) as a:
    with P.dry_run():
        patched = torch.empty is not empty and bool(torch.empty(64).eq(0).all()) \
            and bool(x.new_empty(8, 8).eq(0).all())
        for bk, warps in [(128, 4), (256, 8), (512, 4), (128, 4), (256, 8)]:   # two repeats: handed out once
            router(bk, warps)
    handed = len(a.pending)
    P.wait("test")
    compiled, failed, why = a.compiled, a.failed, a.failures
ahead = files()
kernels = [router(bk, warps, warmup=True)   # the real compile: every variant from the disk cache
           for bk, warps in [(128, 4), (256, 8), (512, 4)]]
# the launcher a worker builds is the one the first launch asks for (the same C source, so the same cache entry)
import triton.backends.nvidia.driver as nv       # Triton 3.6 (the H200's) builds one per signature; 3.9 has none
make_launcher = getattr(nv, "make_launcher", None)
spec = {}
triton.knobs.runtime.jit_cache_hook = lambda **kw: spec.update(kw["compile"]) or False
R._router_logits_kernel.device_caches.clear()
k = router(128, 4, warmup=True)
triton.knobs.runtime.jit_cache_hook = None
def launcher(src):
    names = src.fn.arg_names
    constants = {((names.index(i),) if isinstance(i, str) else i): v for i, v in src.constants.items()}
    return make_launcher(constants, dict(src.signature), getattr(k.metadata, "tensordesc_meta", None))
rebuilt, _ = P.variant_source(R._router_logits_kernel.__module__, "_router_logits_kernel",
                              R._router_logits_kernel.cache_key, spec["specialization_data"], StandIn().get_current_target())
print(json.dumps(dict(patched=patched, restored=torch.empty is empty and "new_empty" not in vars(torch.Tensor),
                      handed=handed, compiled=compiled, failed=failed, why=why, ahead=ahead, after=files(),
                      untouched=bool(torch.equal(out, before)), same_launcher=make_launcher and launcher(rebuilt) == launcher(k.src))))
""", tmp_path)
    assert r["patched"] and r["restored"], r
    assert (r["handed"], r["compiled"], r["failed"]) == (3, 3, 0), r
    assert r["ahead"] > 0 and r["after"] == r["ahead"], f"the real compile wrote to the cache again: {r}"
    assert r["untouched"], "a dry run launched a kernel"
    assert r["same_launcher"] in (None, True), "the launcher a worker builds differs from the first launch's"


def test_what_the_workers_cannot_compile_is_left_to_the_real_run(tmp_path):
    r = run(r"""
def make():
    @triton.jit
    def local_kernel(x_ptr, N: tl.constexpr):        # not a module attribute: the workers cannot find it
        tl.store(x_ptr + tl.arange(0, N), tl.load(x_ptr + tl.arange(0, N)) * 2)
    return local_kernel
local = make()

@triton.autotune([triton.Config({"N": 16}), triton.Config({"N": 32})], key=["M"])
@triton.jit
def tuned_kernel(x_ptr, M, N: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, N), tl.load(x_ptr + tl.arange(0, N)) + M)

v = torch.randn(64)
with P.ahead(torch.device("cuda"), workers=2) as a:
    with P.dry_run():
        local[(1,)](v, N=32)
        tuned_kernel[(1,)](v, 7)             # its choice needs timed launches: not handed out, not tuned
        router(128, 4)
    handed = len(a.pending)
    P.wait("test")
    compiled, failed, why = a.compiled, a.failed, a.failures
ahead = files()
local.run(v, N=32, grid=(1,), warmup=True)
print(json.dumps(dict(handed=handed, compiled=compiled, failed=failed, why=why, tuned=len(tuned_kernel.cache),
                      ahead=ahead, after=files())))
""", tmp_path)
    assert (r["handed"], r["compiled"], r["failed"]) == (2, 1, 1), r
    assert r["tuned"] == 0, "a dry run picked an autotuned config without timing it"
    assert r["after"] > r["ahead"], f"the real run did not compile what the workers left: {r}"


def test_off_on_the_cpu_and_no_dry_run_outside_it():
    import pytest
    import torch
    from kestrel.runtime import precompile as P
    with P.ahead(torch.device("cpu")) as a:
        assert a is None and not P.active()
        with pytest.raises(RuntimeError, match="outside"):      # it would run the stretch for real
            with P.dry_run():
                pass
        P.wait("nothing")
