#!/usr/bin/env python3
"""Snapshot-copy kernel bandwidth on one GPU, against the device-to-device copy peak.

Builds a mamba pool shaped like the large dummy Qwen3.5 model (12 GDN layers,
HV=48, V=K=128 fp32 temporal state, bf16 conv state of conv_dim
48*128 + 2*16*128 = 10240 and K-1 = 3, 64 slots + the dummy slot), times
``copy_state_slots`` for a few pair counts with CUDA events (warm-up, median),
and prints GB/s (bytes read + written) and the share of the peak measured in
the same run by one large contiguous ``dst.copy_(src)``; the last column is a
contiguous ``copy_`` of the same bytes as the call (what one launch of that size
can reach). ``--layers 48`` gives a Qwen3.5-27B-sized image (48 GDN layers).

    python benchmarks/micro/snapshot_copy_gpu.py [--pairs 1,4,16] [--block-bytes 16384,32768]
"""

import argparse
import time

import torch
from gpu_timing import median_ms

from hpc_radix.kernels.snapshot_copy import (
    copy_state_slots,
    copy_state_slots_reference,
    moved_bytes,
)

TARGET_SHARE = 0.80
SLEEP_CYCLES = 5_000_000  # a few ms of GPU time, longer than any host enqueue


def build_pool(layers, slots, heads, head_dim, conv_dim, conv_width):
    conv = torch.randn(layers, slots + 1, conv_dim, conv_width - 1, device="cuda").to(torch.bfloat16)
    temporal = torch.randn(layers, slots + 1, heads, head_dim, head_dim, device="cuda")
    return [conv, temporal]


def median_seconds(fn, iters, warmup):
    """Median device time of ``fn`` (host launch cost kept out)."""
    return median_ms(fn, iters, warmup, sleep_cycles=SLEEP_CYCLES) / 1e3


def host_seconds_per_call(fn, iters):
    """Host time to enqueue one call (what the scheduler thread pays)."""
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - begin
    torch.cuda.synchronize()
    return elapsed / iters


def contiguous_copy_rate(moved_bytes, iters, warmup):
    """GB/s (read + write) of one contiguous ``dst.copy_(src)`` moving ``moved_bytes``."""
    src = torch.empty(moved_bytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return moved_bytes / median_seconds(lambda: dst.copy_(src), iters, warmup) / 1e9


def pair_lists(n_pairs, slots):
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(n_pairs)) + 1
    return order[:n_pairs].tolist(), order[n_pairs : 2 * n_pairs].tolist()


def check_exact(pool, src, dst, block_bytes):
    expected = [t.clone() for t in pool]
    copy_state_slots_reference(expected, src, dst)
    copy_state_slots(pool, src, dst, block_bytes=block_bytes)
    torch.cuda.synchronize()
    for got, want in zip(pool, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "kernel differs from reference"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--heads", type=int, default=48)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--conv-dim", type=int, default=48 * 128 + 2 * 16 * 128)
    parser.add_argument("--conv-width", type=int, default=4)
    parser.add_argument("--pairs", default="1,4,16")
    parser.add_argument("--block-bytes", default="16384")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--peak-gib", type=float, default=2.0)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    # the peak: a copy large enough that launch and ramp-up vanish
    peak = contiguous_copy_rate(2 * int(args.peak_gib * (1 << 30)), args.iters, args.warmup)
    torch.cuda.empty_cache()
    pool = build_pool(args.layers, args.slots, args.heads, args.head_dim, args.conv_dim, args.conv_width)
    per_slot = moved_bytes(pool, 1) // 2
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"pool: conv {tuple(pool[0].shape)} {pool[0].dtype}, temporal {tuple(pool[1].shape)} "
          f"{pool[1].dtype}; {per_slot / 1e6:.2f} MB per slot image")
    print(f"device-to-device copy peak ({args.peak_gib:g} GiB copy_): {peak:.0f} GB/s (read + write)")
    print()
    header = (f"{'pairs':>5} {'block':>6} {'MB moved':>9} {'device us':>9} {'GB/s':>7} {'% peak':>7} "
              f"{'host us':>8} {'torch GB/s':>10} {'same-size copy_':>15}")
    print(header)
    print("-" * len(header))
    worst = 1.0
    for block_bytes in (int(b) for b in args.block_bytes.split(",")):
        for n_pairs in (int(p) for p in args.pairs.split(",")):
            src, dst = pair_lists(n_pairs, args.slots)
            check_exact(pool, src, dst, block_bytes)
            src_dev = torch.tensor(src, device="cuda")
            dst_dev = torch.tensor(dst, device="cuda")
            call = lambda: copy_state_slots(pool, src_dev, dst_dev, block_bytes=block_bytes,  # noqa: E731
                                            num_warps=args.num_warps, validate=False)
            kernel = median_seconds(call, args.iters, args.warmup)
            host = host_seconds_per_call(call, args.iters)
            reference = median_seconds(
                lambda: copy_state_slots_reference(pool, src, dst), args.iters, args.warmup
            )
            moved = moved_bytes(pool, n_pairs)
            same_size = contiguous_copy_rate(moved, args.iters, args.warmup)
            rate = moved / kernel / 1e9
            worst = min(worst, rate / peak)
            print(f"{n_pairs:>5} {block_bytes:>6} {moved / 1e6:>9.1f} {kernel * 1e6:>9.1f} {rate:>7.0f} "
                  f"{100 * rate / peak:>6.1f}% {host * 1e6:>8.1f} {moved / reference / 1e9:>10.0f} "
                  f"{same_size:>7.0f} ({100 * same_size / peak:.0f}%)")
    verdict = "meets" if worst >= TARGET_SHARE else "misses"
    print(f"\nworst case {100 * worst:.1f}% of peak: {verdict} the {100 * TARGET_SHARE:.0f}% target")


if __name__ == "__main__":
    main()
