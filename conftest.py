"""Repo-wide pytest set-up, loaded before any test module imports a package."""

import os

import torch

# Triton kernels only run on a CPU under the interpreter, and it must be on before any @triton.jit runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny models are dominated by per-op overhead, which extra intra-op threads only add to on a 2-core machine.
torch.set_num_threads(1)
