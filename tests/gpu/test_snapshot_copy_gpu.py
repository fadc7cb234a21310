"""Snapshot-copy kernel on CUDA: byte-exact against the torch reference.

The kernel module is imported inside the tests: importing it decides, once per
process, whether Triton compiles or interprets (TRITON_INTERPRET).
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def cuda_pool(layers=12, slots=17, heads=8, head_dim=128, conv_dim=2048, temporal_dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    conv = torch.randn(layers, slots, conv_dim, 3, device="cuda", generator=g).to(torch.bfloat16)
    temporal = torch.randn(layers, slots, heads, head_dim, head_dim, device="cuda", generator=g)
    return [conv, temporal.to(temporal_dtype)]


def compiled_kernel_module():
    from hpc_radix.kernels import snapshot_copy

    if type(snapshot_copy._copy_state_slots_kernel).__name__ == "InterpretedFunction":
        pytest.skip("TRITON_INTERPRET was set when the kernel was imported: run tests/gpu on its own")
    return snapshot_copy


def copy_and_compare(pool, src, dst, **kwargs):
    kernels = compiled_kernel_module()
    expected = [t.clone() for t in pool]
    kernels.copy_state_slots_reference(expected, src, dst)
    kernels.copy_state_slots(pool, src, dst, **kwargs)
    torch.cuda.synchronize()
    for got, want in zip(pool, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("n_pairs", [1, 4, 8])
@pytest.mark.parametrize("block_bytes", [4096, 16384, 65536])
def test_exact_on_cuda(n_pairs, block_bytes):
    pool = cuda_pool()
    src = list(range(1, 1 + n_pairs))
    dst = list(range(9, 9 + n_pairs))
    copy_and_compare(pool, src, dst, block_bytes=block_bytes)


def test_repeated_sources_device_indices_and_bf16_state():
    pool = cuda_pool(temporal_dtype=torch.bfloat16)
    src = torch.tensor([3, 3, 5], device="cuda")
    dst = torch.tensor([10, 11, 12], device="cuda")
    copy_and_compare(pool, src, dst, validate=False)


def test_odd_sizes_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(1)
    pool = [
        torch.randn(3, 7, 5, 3, device="cuda", generator=g).to(torch.bfloat16),  # 30-byte rows
        torch.randint(0, 255, (2, 7, 11), device="cuda", dtype=torch.uint8, generator=g),
    ]
    copy_and_compare(pool, [1, 2], [4, 6], block_bytes=64)
