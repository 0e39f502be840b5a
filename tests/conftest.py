import os

import torch

# Triton kernels run on the CPU through the interpreter; on a GPU machine they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.backends.cuda.matmul.allow_tf32 = False
# under pytest-xdist each worker gets one core's share: torch's own threads would oversubscribe the machine
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


import pytest  # noqa: E402

from kestrel.catalog._op import CallLog  # noqa: E402


@pytest.fixture
def catalog_calls():
    """Watch a catalog entry during a test (`with catalog_calls.watching(Entry): ...`); the test fails at teardown
    unless the entry's raw_call, reference and compare all ran: a cell test that skipped the comparison is caught."""
    log = CallLog()
    yield log
    assert not log.missing(), f"catalog contract members never ran: {log.missing()}"


# Files by their measured pytest time on the 2-core CI machine (seconds, one worker each, longest first; the rest
# take under 20 s). pytest-xdist's `--dist loadfile` hands out whole files in collection order (pyproject turns off
# its reordering by test count, which put the 60 s two-test test_targets.py last): longest first, the two workers
# end within about one short file of each other. Re-measure with `--durations` when a file grows past 20 s.
SLOW_FILES = (
    "test_parallel_layouts.py",   # 88
    "test_runtime_sampler.py",    # 78
    "test_graphs.py",             # 62
    "test_serve_tools.py",        # 61
    "test_targets.py",            # 60
    "test_serve_hardening.py",    # 53
    "test_spec_targets.py",       # 52
    "test_disagg_serving.py",     # 50
    "test_kv_cache_quant.py",     # 47
    "test_kv_quant_targets.py",   # 41
    "test_w4a16_decode.py",       # 36
    "test_kda_kernels.py",        # 29
    "test_quant_targets.py",      # 28
    "test_serve_openai.py",       # 25
    "test_target_launches.py",    # 24
    "test_dspark_train.py",       # 23
    "test_fp8_weight_read.py",    # 21
    "test_async_scheduling.py",   # 21
    "test_propose_padding.py",    # 21
    "test_catalog_cells.py",      # 21
)


def pytest_collection_modifyitems(config, items):
    """Slow files first (stable: a file's own tests keep their order, the other files theirs)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))
