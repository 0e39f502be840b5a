"""Start-up's Triton compiles, in parallel worker processes instead of one after another.

A cold start compiles every Triton variant the engine will launch: the memory profile's largest steps, the sampler's
variants, the eager steps before each graph capture. Each compile is 0.3-2 s of mostly single-threaded work and they
ran one after another (about 70 s of a 27-layer Kimi Linear start on the H200). Threads do not help much (Triton's
front end holds the GIL: 3.3x at 16 threads, benchmarks/compile_probe.py); processes do.

How a stretch of start-up is compiled ahead:
1. `ahead()`, the context `build_engine` runs in, starts a pool of worker processes early (they import Triton and
   torch while the weights load).
2. `dry_run()` runs the stretch (a warm-up's steps) without launching a Triton kernel: every launch is turned into
   Triton's own `warmup=True` (look up, no launch), and a variant not compiled yet is handed to a worker, which
   compiles it for this GPU into Triton's disk cache, with the C launcher its first launch would build (gcc). The torch ops between the kernels still run, on buffers the
   skipped kernels did not fill: while it lasts, `torch.empty` / `empty_like` / `new_empty` give zeros, so an index
   a skipped kernel should have written reads 0, always in range. Only stretches without a host read of a device
   value may run dry (the decode steps are graph-capturable, so theirs have none; prefill warm-up steps index by
   what the host wrote); the caller resets any state the dry steps wrote.
3. `wait()` collects the workers' results; the stretch then runs for real and loads each kernel from the disk cache.

Nothing depends on it for correctness: a variant a worker could not compile (a kernel it cannot find by module and
name, a different source, an error) is compiled by the real run as before. An autotuned kernel with no tuned choice
yet is left to the real run (a dry run cannot time it). Off without CUDA, under the interpreter, with Triton's cache
off, and with KESTREL_PRECOMPILE=0.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import logging
import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor

import torch

log = logging.getLogger("kestrel.precompile")

_active: "CompileAhead | None" = None


def _enabled(device: torch.device) -> str | None:
    """Why compiling ahead is off here, or None."""
    if os.environ.get("KESTREL_PRECOMPILE", "1") == "0":
        return "KESTREL_PRECOMPILE=0"
    if device.type != "cuda":
        return "not on CUDA"
    from kestrel.kernels import interpreting
    if interpreting():
        return "the Triton interpreter compiles nothing"
    try:
        import triton
        from triton import knobs
        from triton.runtime.jit import JITFunction  # noqa: F401
    except ImportError:
        return "no Triton"
    if knobs.compilation.always_compile or not hasattr(knobs.runtime, "jit_cache_hook"):
        return "Triton's cache is off, or this Triton has no jit_cache_hook"
    return None


def _find_jit(module: str, qualname: str):
    """The JITFunction a kernel's module holds under its name (an autotuner or heuristics unwrapped), or None."""
    from triton.runtime.jit import JITFunction
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    return obj if isinstance(obj, JITFunction) else None


def variant_source(module: str, qualname: str, source_key: str, specialization: str, target):
    """(the ASTSource, the parsed options) of one variant from Triton's serialized specialization data (what
    `JITFunction.preload` reads), or why it cannot be rebuilt here."""
    import triton.language as tl
    from triton.compiler import ASTSource, make_backend
    fn = _find_jit(module, qualname)
    if fn is None:
        return f"{module}.{qualname}: not found"
    if fn.cache_key != source_key:
        return f"{module}.{qualname}: a different source here"
    spec = json.loads(specialization)

    def untuple(v):
        return tuple(untuple(x) for x in v) if isinstance(v, list) else v

    constexprs = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
                  tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
                  for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = dict(zip(map(tuple, spec["attrs_keys"]), spec["attrs_vals"]))
    signature = {k: untuple(v) for k, v in spec["signature"].items()}
    options = make_backend(target).parse_options({k: untuple(v) for k, v in spec["options"].items()})
    return ASTSource(fn, signature, constexprs, attrs), options


def compile_variant(module: str, qualname: str, source_key: str, specialization: str, target) -> str:
    """In a worker: compile one variant for `target`, and its launcher, into Triton's disk cache. Returns "ok..." or
    why not."""
    import triton
    built = variant_source(module, qualname, source_key, specialization, target)
    if isinstance(built, str):
        return built
    src, options = built
    kernel = triton.compile(src, target=target, options=options.__dict__)
    if target.backend != "cuda":
        return "ok"
    try:       # the C launcher the first launch builds (a gcc run per signature), into the same disk cache
        from triton.backends.nvidia.driver import CudaLauncher
        CudaLauncher(src, kernel.metadata)
    except Exception as e:      # noqa: BLE001 (no libcuda here, say: the first launch builds it)
        return f"ok, its launcher left to the first launch ({type(e).__name__})"
    return "ok"


def _worker_init() -> None:
    import triton  # noqa: F401  (imported once per worker, while the parent loads weights)
    import triton.compiler.compiler  # noqa: F401


class CompileAhead:
    """A pool of compile workers and the variants handed to them."""

    def __init__(self, workers: int):
        self.workers = workers
        ctx = multiprocessing.get_context("spawn")      # never fork a process that holds a CUDA context
        self.pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init)
        self.pending: dict[str, tuple[str, Future]] = {}   # variant key -> (name, the worker's result)
        self.compiled = self.failed = 0
        # of the dry runs so far: launches seen, variants compiled here instead (a constexpr the hook data cannot
        # hold), autotuned launches left to the real run, seconds inside dry runs
        self.launches = self.inline = self.untuned = 0
        self.dry_s = 0.0
        self.launcher_left: list[str] = []       # variants whose launcher a worker could not build (the first 3)
        self.failures: list[str] = []        # why each variant left to the real run was (the first 20)
        self.seconds = 0.0
        self._target = None

    def _target_for(self):
        if self._target is None:
            from triton.runtime import driver
            self._target = driver.active.get_current_target()
        return self._target

    def _hook(self, *, key, fn, compile, **_) -> bool:
        """Triton's jit_cache_hook, on a variant not in the in-memory cache: hand it to a worker and skip it."""
        jit = fn.jit_function
        name = f"{fn.module}.{fn.name}"
        variant = f"{name}:{jit.cache_key}:{compile['specialization_data']}"
        if variant not in self.pending:
            try:
                future = self.pool.submit(compile_variant, fn.module, fn.name, jit.cache_key,
                                          compile["specialization_data"], self._target_for())
            except Exception as e:      # noqa: BLE001 (a broken pool: this variant compiles here, now)
                log.warning("compiling ahead: %s not handed out (%s); compiled in this process", name, e)
                return False
            self.pending[variant] = (name, future)
        return True

    @contextlib.contextmanager
    def dry_run(self):
        from triton import knobs
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
        run, tune = JITFunction.run, Autotuner.run
        empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

        def dry_launch(self_, *args, grid, warmup, **kwargs):
            self.launches += 1
            try:
                return run(self_, *args, grid=grid, warmup=True, **kwargs)
            except TypeError as e:      # a constexpr Triton's hook data cannot hold (json): compiled here, now
                if "serializable" not in str(e):
                    raise
                knobs.runtime.jit_cache_hook = hook
                self.inline += 1
                try:
                    return run(self_, *args, grid=grid, warmup=True, **kwargs)
                finally:
                    knobs.runtime.jit_cache_hook = self._hook

        def dry_tune(self_, *args, **kwargs):
            if len(self_.configs) > 1:       # its choice is made by timing launches: only from a tuned cache
                names = dict(zip(self_.arg_names, args)) | kwargs
                key = [names[k] for k in self_.keys if k in names]
                key += [str(v.dtype) for k, v in names.items() if k in self_.arg_names and hasattr(v, "dtype")]
                if tuple(key) not in self_.cache:
                    self.untuned += 1
                    return None
            return tune(self_, *args, **kwargs)

        def zeros(*args, **kwargs):
            return empty(*args, **kwargs).zero_()

        def zeros_like(*args, **kwargs):
            return empty_like(*args, **kwargs).zero_()

        def new_zeros(self_, *args, **kwargs):
            return new_empty(self_, *args, **kwargs).zero_()

        hook = knobs.runtime.jit_cache_hook
        own_new_empty = "new_empty" in vars(torch.Tensor)      # else it is TensorBase's, and goes back to being so
        JITFunction.run, Autotuner.run = dry_launch, dry_tune
        torch.empty, torch.empty_like, torch.Tensor.new_empty = zeros, zeros_like, new_zeros
        knobs.runtime.jit_cache_hook = self._hook
        t0 = time.perf_counter()
        try:
            yield self
        finally:
            self.dry_s += time.perf_counter() - t0
            knobs.runtime.jit_cache_hook = hook
            JITFunction.run, Autotuner.run = run, tune
            torch.empty, torch.empty_like = empty, empty_like
            if own_new_empty:
                torch.Tensor.new_empty = new_empty
            else:
                del torch.Tensor.new_empty

    def wait(self, what: str) -> None:
        """Collect every variant handed out so far; one log line."""
        t0 = time.perf_counter()
        n, failed = len(self.pending), []
        for name, future in self.pending.values():
            try:
                result = future.result()
            except Exception as e:             # noqa: BLE001 (the real run compiles it and reports its error)
                result = f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            if not result.startswith("ok"):
                failed.append(result)
            elif result != "ok" and len(self.launcher_left) < 3:
                self.launcher_left.append(f"{name}: {result}")
        self.pending.clear()
        self.compiled += n - len(failed)
        self.failed += len(failed)
        self.failures += failed[:20 - len(self.failures)]
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        log.info("compiled ahead (%s): %d Triton variants in %d processes, %.1f s waited; dry runs so far %.1f s, "
                 "%d launches, %d compiled in this process, %d autotuned ones left%s%s", what, n - len(failed),
                 self.workers, seconds, self.dry_s, self.launches, self.inline, self.untuned,
                 f"; {len(failed)} left to the real run: {failed[0]}" if failed else "",
                 f"; launchers left: {self.launcher_left[0]}" if self.launcher_left else "")

    def close(self) -> None:
        for _, future in self.pending.values():
            future.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def ahead(device: torch.device, workers: int | None = None):
    """Within (where compiling ahead is on: `active()`), `dry_run()` / `wait()` compile ahead, one pool for the whole
    start-up."""
    global _active
    why = _enabled(device)
    if why is not None or _active is not None:
        if why is not None and device.type == "cuda":
            log.info("compiling ahead is off: %s", why)
        yield None
        return
    workers = workers or max(1, min(16, (os.cpu_count() or 2) - 1))
    _active = CompileAhead(workers)
    for _ in range(workers):           # start every worker now: their imports overlap the weights' loading
        _active.pool.submit(int)
    try:
        yield _active
    finally:
        _active.close()
        _active = None


@contextlib.contextmanager
def dry_run():
    """A stretch of start-up whose Triton variants compile in the workers. Only where `active()`: elsewhere the
    stretch would run for real, twice over with the real run after it."""
    if _active is None:
        raise RuntimeError("precompile.dry_run() outside precompile.ahead(): check precompile.active() first")
    with _active.dry_run() as a:
        yield a


def active() -> bool:
    """Whether start-up compiles ahead here (inside `ahead`, where it is on): callers skip their dry runs if not."""
    return _active is not None


def wait(what: str) -> None:
    if _active is not None:
        _active.wait(what)
