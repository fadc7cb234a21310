"""Shared fixtures of the GPU tests."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    """The tiny random-weight Qwen3.5 (``HPC_TEST_MODEL`` when it names one; else written)."""
    model = os.environ.get("HPC_TEST_MODEL")
    if not (model and os.path.isfile(os.path.join(model, "config.json"))):
        model = str(tmp_path_factory.mktemp("tiny-qwen35"))
        subprocess.run([sys.executable, os.path.join(HERE, "tiny_qwen.py"), model], check=True)
    return model
