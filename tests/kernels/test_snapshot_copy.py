"""Snapshot-copy kernel against the torch reference.

Without a GPU the kernel runs under the Triton interpreter on CPU tensors; with
one (a GPU job running the whole suite) the same tests run compiled on CUDA.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is first imported

from hpc_radix.kernels import snapshot_copy  # noqa: E402
from hpc_radix.kernels.snapshot_copy import (  # noqa: E402
    check_pairs,
    copy_state_slots,
    copy_state_slots_reference,
    moved_bytes,
)

INTERPRETED = type(snapshot_copy._copy_state_slots_kernel).__name__ == "InterpretedFunction"
DEVICE = "cpu" if INTERPRETED else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("kernel compiled for a GPU, none here (imported before TRITON_INTERPRET was set)",
                allow_module_level=True)

SLOTS = 9  # like MambaPool: size + 1


def qwen35_like_pool(seed=0, layers=3, conv_dim=40, heads=2, head_v=8, head_k=8):
    """bf16 conv [L, S, conv_dim, K-1] and fp32 temporal [L, S, HV, V, K]."""
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(layers, SLOTS, conv_dim, 3, generator=g).to(torch.bfloat16)
    temporal = torch.randn(layers, SLOTS, heads, head_v, head_k, generator=g)
    return [conv.to(DEVICE), temporal.to(DEVICE)]


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


def assert_same_bytes(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert torch.equal(as_bytes(a), as_bytes(e))


def run_both(pool, src, dst, block_bytes=4096):
    expected = [t.clone() for t in pool]
    copy_state_slots_reference(expected, src, dst)
    before = [t.clone() for t in pool]
    copy_state_slots(pool, src, dst, block_bytes=block_bytes)
    assert_same_bytes(pool, expected)
    return before


def test_many_pairs():
    pool = qwen35_like_pool()
    before = run_both(pool, [1, 2, 3, 4], [5, 6, 7, 8])
    assert torch.equal(pool[1][:, 8], before[1][:, 4])
    assert torch.equal(pool[0][:, 1:5], before[0][:, 1:5])  # sources untouched


def test_single_pair_leaves_other_slots_alone():
    pool = qwen35_like_pool(seed=1)
    before = run_both(pool, [3], [7])
    for t, old in zip(pool, before):
        untouched = [s for s in range(SLOTS) if s != 7]
        assert torch.equal(as_bytes(t[:, untouched]), as_bytes(old[:, untouched]))


def test_repeated_sources():
    pool = qwen35_like_pool(seed=2)
    run_both(pool, torch.tensor([2, 2, 5, 2], device=DEVICE), torch.tensor([0, 1, 6, 8]))


def test_rows_larger_than_a_block():
    # temporal row = 2*8*8*4 = 512 bytes and conv row = 240 bytes, 64-byte blocks
    pool = qwen35_like_pool(seed=3)
    run_both(pool, [1, 4], [2, 3], block_bytes=64)


def test_odd_sizes_fall_back_to_narrow_units():
    # conv row 7*3*2 = 42 bytes (2-byte unit), a 1-byte-element tensor, a 2-d [L, S] tensor
    g = torch.Generator().manual_seed(4)
    pool = [
        torch.randn(2, SLOTS, 7, 3, generator=g).to(torch.bfloat16),
        torch.randint(0, 255, (4, SLOTS, 5), generator=g, dtype=torch.uint8),
        torch.randn(3, SLOTS, generator=g),
    ]
    pool = [t.to(DEVICE) for t in pool]
    run_both(pool, [1, 2, 8], [3, 4, 0], block_bytes=16)


def test_bf16_temporal_and_many_tensors():
    g = torch.Generator().manual_seed(5)
    pool = [torch.randn(2, SLOTS, 16, 3, generator=g).to(torch.bfloat16) for _ in range(3)]
    pool.append(torch.randn(2, SLOTS, 2, 8, 8, generator=g).to(torch.bfloat16))
    pool.append(torch.randn(4, SLOTS, 3, 4, generator=g, dtype=torch.float64))
    pool = [t.to(DEVICE) for t in pool]
    run_both(pool, [0, 1], [2, 3])


def test_views_into_a_larger_buffer():
    # Tensors need not be whole allocations: a layer-strided view (every other layer)
    base = qwen35_like_pool(seed=6, layers=4)
    pool = [base[0][::2], base[1][1::2]]
    run_both(pool, [5], [6])


def test_no_pairs_is_a_no_op():
    pool = qwen35_like_pool()
    before = [t.clone() for t in pool]
    copy_state_slots(pool, [], [])
    assert_same_bytes(pool, before)


@pytest.mark.parametrize(
    "src, dst, message",
    [
        ([1, 2], [3, 3], "destination slot 3 appears more than once"),
        ([1, 2], [2, 4], "slot 2 is both a source and a destination"),
        ([5], [5], "slot 5 is both a source and a destination"),
        ([1], [SLOTS], f"slot {SLOTS} is out of range [0, {SLOTS})"),
        ([-1], [2], f"slot -1 is out of range [0, {SLOTS})"),
        ([1, 2], [3], "2 source slots but 1 destination slots"),
    ],
)
def test_refused_pairs(src, dst, message):
    pool = qwen35_like_pool()
    for copy in (copy_state_slots, copy_state_slots_reference):
        with pytest.raises(ValueError) as err:
            copy(pool, src, dst)
        assert str(err.value) == message


def test_refused_tensors_and_block_sizes():
    pool = qwen35_like_pool()
    with pytest.raises(ValueError, match="must be contiguous"):
        copy_state_slots([pool[0].transpose(2, 3)], [1], [2])
    with pytest.raises(ValueError, match="expected \\[layers, slots, ...\\]"):
        copy_state_slots([torch.zeros(4, device=DEVICE)], [1], [2])
    with pytest.raises(ValueError, match="block_bytes=100: must be a power of two >= 16"):
        copy_state_slots(pool, [1], [2], block_bytes=100)
    with pytest.raises(ValueError, match="no state tensors"):
        copy_state_slots([], [1], [2])


def test_check_pairs_accepts_disjoint_pairs():
    check_pairs([1, 1, 2], [3, 4, 5], n_slots=6)


def test_moved_bytes_counts_read_and_write():
    pool = qwen35_like_pool()  # per slot: 3 layers x (240 + 512) bytes
    assert moved_bytes(pool, 2) == 2 * 2 * 3 * (240 + 512)
