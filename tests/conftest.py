"""Shared pytest configuration."""
import os
import sys

# tests may use the benchmark workloads (the tiny tokenizer's ChatML table)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
