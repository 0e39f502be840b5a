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
