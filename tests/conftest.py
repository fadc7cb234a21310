"""Shared pytest configuration."""
import os
import sys

import torch

# tests may use the benchmark workloads (the tiny tokenizer's ChatML table)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU every Triton kernel (ours and SGLang's) runs under the interpreter; the flag is
# read when a kernel is defined, so it is set before any test module imports one.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
