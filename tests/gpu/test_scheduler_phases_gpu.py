"""The GPU-time clock of ``HPC_SCHEDULER_PHASES`` (patches/scheduler_phases.GpuClock) with real
CUDA events: a pass is counted once it has run, never waited for, its layers apart, and a CUDA
graph capture passes through it untouched."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model(gpu, backend, a):
    """A forward of one GDN-like and one full-attention layer, each a few matmuls."""
    def layer(backend, layer, forward_batch):
        x = a
        for _ in range(4):
            x = x @ a / 64
        return x

    def forward(runner, batch):
        if batch.forward_mode.is_extend():
            gpu.layer(layer, backend, SimpleNamespace(layer_id=0), batch)
            gpu.layer(layer, backend, SimpleNamespace(layer_id=3), batch)
        return a @ a
    return forward


def test_passes_are_timed_by_events_once_run_and_graph_capture_is_left_alone():
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from hpc_radix.patches.scheduler_phases import GpuClock

    gpu = GpuClock()
    backend = object.__new__(HybridLinearAttnBackend)
    backend.full_attn_layers = {3}
    a = torch.randn(4096, 4096, device="cuda")
    forward = _model(gpu, backend, a)
    extend = SimpleNamespace(forward_mode=ForwardMode.EXTEND, extend_num_tokens=512, batch_size=2)
    decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, extend_num_tokens=None, batch_size=4)
    for _ in range(3):
        gpu.forward(forward, None, extend)
        gpu.forward(forward, None, decode)
    assert gpu.pending, "the passes were waited for: none left pending behind the busy GPU"
    torch.cuda.synchronize()
    line = gpu.line()
    assert gpu.counts == {"extend": 3, "decode": 3, "extend_tokens": 1536, "decode_tokens": 12}
    assert gpu.ms["gdn"] > 0 and gpu.ms["attention"] > 0 and gpu.ms["decode"] > 0
    assert gpu.ms["extend"] >= gpu.ms["gdn"] + gpu.ms["attention"], gpu.ms
    assert line.startswith("gpu: extend ") and "in 3 passes (1,536 tokens;" in line, line
    assert len(gpu._spare) == 3 * 6 + 3 * 2                      # every event read, to reuse

    gpu.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):                                # SGLang's decode graph capture
        gpu.forward(forward, None, decode)
    graph.replay()
    torch.cuda.synchronize()
    assert not gpu.pending and gpu.line() == ""
