"""Byte-run copies (kernels/host_copy.py) against the torch reference.

Without a GPU the kernel runs under the Triton interpreter between CPU tensors; on a GPU
between device memory and pinned host memory (the host tier's two sides), and so do the copy
engines' batched copies.
"""
import random

import pytest
import torch

from hpc_radix.kernels.host_copy import (Run, copy_engine_path, copy_runs, copy_runs_dma,
                                         copy_runs_reference)

CUDA = torch.cuda.is_available()


def places(seed=0):
    g = torch.Generator().manual_seed(seed)
    device = [torch.randint(0, 255, (3 * 65536 + 32,), generator=g, dtype=torch.uint8)]
    host = [torch.randint(0, 255, (2 * 65536,), generator=g, dtype=torch.uint8) for _ in range(2)]
    if CUDA:
        device = [t.cuda() for t in device]
        host = [t.pin_memory() for t in host]
    return device + host                          # the anchor, a device buffer, comes first


def random_runs(sizes, count, rng, align):
    """Runs whose destinations overlap no other destination and no source."""
    runs, spans = [], []

    def free(place, a, b):
        return not any(p == place and a < e and s < b for p, s, e in spans)

    while len(runs) < count:
        src, dst = rng.randrange(len(sizes)), rng.randrange(len(sizes))
        length = rng.randrange(1, 40000) // align * align or align
        s_off = rng.randrange(0, sizes[src] - length) // align * align
        d_off = rng.randrange(0, sizes[dst] - length) // align * align
        if not (free(src, s_off, s_off + length) and free(dst, d_off, d_off + length)) or \
                (src == dst and s_off < d_off + length and d_off < s_off + length):
            continue
        spans += [(src, s_off, s_off + length), (dst, d_off, d_off + length)]
        runs.append(Run(src, s_off, dst, d_off, length))
    return runs


def as_bytes(ps):
    return [p.cpu().view(torch.uint8).clone() for p in ps]


@pytest.mark.parametrize("align", [1, 2, 16], ids=["bytes", "halves", "aligned"])
@pytest.mark.parametrize("programs", [1, 3, 8])
def test_runs_match_the_reference(align, programs):
    rng = random.Random(align * 10 + programs)
    got, want = places(1), places(1)
    sizes = [p.numel() for p in got]
    runs = random_runs(sizes, 12, rng, align)
    copy_runs(got, runs, block_bytes=4096, programs=programs)
    copy_runs_reference(want, runs)
    if CUDA:
        torch.cuda.synchronize()
    for g, w in zip(as_bytes(got), as_bytes(want)):
        assert torch.equal(g, w)


def test_nothing_to_copy_and_bad_runs():
    ps = places()
    copy_runs(ps, [])
    with pytest.raises(ValueError, match="reaches past"):
        copy_runs(ps, [Run(1, 131000, 0, 0, 100)])
    with pytest.raises(ValueError, match="no place 5"):
        copy_runs(ps, [Run(5, 0, 0, 0, 1)])
    with pytest.raises(ValueError, match="destinations of .* overlap"):
        copy_runs(ps, [Run(1, 0, 0, 0, 64), Run(2, 0, 0, 32, 64)])
    with pytest.raises(ValueError, match="source of .* overlaps"):
        copy_runs(ps, [Run(1, 0, 0, 0, 64), Run(0, 32, 2, 0, 64)])
    with pytest.raises(ValueError, match="power of two"):
        copy_runs(ps, [Run(1, 0, 0, 0, 64)], block_bytes=3000)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("align", [1, 2, 16], ids=["bytes", "halves", "aligned"])
def test_copy_engines_match_the_reference(align):
    usable, what = copy_engine_path()
    assert usable, what             # the H200's driver has cuMemcpyBatchAsync: a miss is a bug
    rng = random.Random(align)
    got, want = places(2), places(2)
    runs = random_runs([p.numel() for p in got], 40, rng, align) + [Run(1, 0, 0, 0, 0)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        copy_runs_dma(got, runs)
    side.synchronize()
    copy_runs_reference(want, runs)
    for g, w in zip(as_bytes(got), as_bytes(want)):
        assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_copy_engines_copy_in_parts_each_followed_by_its_callback():
    """A restore copied a layer at a time: one call per part (an empty run and an empty part
    among them), ``after_part`` after each in order, the same bytes as the reference."""
    rng = random.Random(7)
    got, want = places(3), places(3)
    runs = random_runs([p.numel() for p in got], 30, rng, 16)
    runs = runs[:10] + [Run(1, 0, 0, 0, 0)] + runs[10:]
    ends = [4, 11, 11, 25, len(runs)]
    side, parts = torch.cuda.Stream(), []
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        copy_runs_dma(got, runs, ends=ends, after_part=parts.append)
    side.synchronize()
    copy_runs_reference(want, runs)
    assert parts == [0, 1, 2, 3, 4]
    for g, w in zip(as_bytes(got), as_bytes(want)):
        assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_copy_engines_refuse_bad_runs_and_the_legacy_stream():
    ps = places()
    with pytest.raises(ValueError, match="legacy default stream"):
        copy_runs_dma(ps, [Run(1, 0, 0, 0, 64)])
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        copy_runs_dma(ps, [])
        with pytest.raises(ValueError, match="destinations of .* overlap"):
            copy_runs_dma(ps, [Run(1, 0, 0, 0, 64), Run(2, 0, 0, 32, 64)])


@pytest.mark.skipif(CUDA, reason="the path without a GPU")
def test_copy_engines_need_a_gpu():
    assert copy_engine_path() == (False, "no CUDA device")
    with pytest.raises(RuntimeError, match="copy engines unavailable: no CUDA device"):
        copy_runs_dma(places(), [Run(1, 0, 0, 0, 64)])
