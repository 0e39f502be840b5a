import os

import torch

# Triton kernels run on the CPU through the interpreter; on a GPU machine they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.backends.cuda.matmul.allow_tf32 = False
