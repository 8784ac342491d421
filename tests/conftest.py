"""Test set-up: without a GPU, Triton kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, so this runs
before any transformd module is imported by a test.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
