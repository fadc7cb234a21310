#!/usr/bin/env python3
"""Host-tier copies on one GPU: the run-copy kernel against a contiguous pinned copy.

Moves what the host tier moves, both directions, between device buffers and pinned host memory:
- blocks: 64-token pages of every full-attention layer's K and V (the large dummy Qwen3.5:
  4 full-attention layers, 4 KV heads of 256, bf16: 128 KiB per plane page), scattered pages;
- images: a GDN layer's conv state (10240 x 3 bf16) and recurrent state (48 x 128 x 128 fp32)
  per layer, 12 layers, from scattered slots, packed into slabs.
Prints GB/s (bytes moved once), the share of a contiguous pinned copy of the same total measured
in the same run, for the kernel at each grid and for the copy engines (one cuMemcpyBatchAsync),
and how much a concurrent 8192^3 bf16 matmul slows down while each copies, and while one idle
block (a sleep kernel) sits on an SM. Targets (issue): >= 45 GB/s and >= 85 % of the contiguous
copy; <= 5 % slowdown of concurrent compute.

    python benchmarks/micro/host_copy_gpu.py [--blocks 256] [--images 8] [--programs 8,16,132]
"""
import argparse
import random
import statistics

import torch
from gpu_timing import median_ms

from hpc_radix.kernels.host_copy import Run, copy_engine_path, copy_runs, copy_runs_dma

PAGE_TOKENS, KV_HEADS, HEAD_DIM, FULL_LAYERS = 64, 4, 256, 4
GDN_LAYERS, CONV_DIM, HV, D = 12, 10240, 48, 128
SLEEP_CYCLES = 100_000_000             # ~50 ms: longer than building any table here


def block_case(n_blocks, rng):
    pages = 4 * n_blocks
    planes = [torch.randn(pages * PAGE_TOKENS, KV_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
              for _ in range(2 * FULL_LAYERS)]
    page_bytes = PAGE_TOKENS * KV_HEADS * HEAD_DIM * 2
    slab = len(planes) * page_bytes
    host = torch.empty(n_blocks * slab, dtype=torch.uint8).pin_memory()
    chosen = rng.sample(range(pages), n_blocks)
    places = planes + [host]
    h = len(planes)
    d2h = [Run(i, p * page_bytes, h, b * slab + i * page_bytes, page_bytes)
           for b, p in enumerate(chosen) for i in range(len(planes))]
    return places, d2h, n_blocks * slab


def image_case(n_images, rng):
    slots = 4 * n_images
    conv = torch.randn(GDN_LAYERS, slots, CONV_DIM, 3, device="cuda").to(torch.bfloat16)
    ssm = torch.randn(GDN_LAYERS, slots, HV, D, D, device="cuda")
    parts = [(conv, CONV_DIM * 3 * 2), (ssm, HV * D * D * 4)]
    image = GDN_LAYERS * sum(size for _, size in parts)
    host = torch.empty(n_images * image, dtype=torch.uint8).pin_memory()
    chosen = rng.sample(range(slots), n_images)
    d2h, places = [], [conv, ssm, host]
    for k, slot in enumerate(chosen):
        at = k * image
        for layer in range(GDN_LAYERS):
            for i, (t, size) in enumerate(parts):
                d2h.append(Run(i, t[layer, slot].data_ptr() - t.data_ptr(), 2, at, size))
                at += size
    return places, d2h, n_images * image


def reverse(runs):
    return [Run(r.dst, r.dst_offset, r.src, r.src_offset, r.length) for r in runs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--programs", default="8,16,132")
    args = ap.parse_args()
    rng = random.Random(0)
    programs = [int(x) for x in args.programs.split(",")]
    engines, what = copy_engine_path()
    print(f"copy engines: {what}")
    copiers = [(f"{p} prog", lambda places, runs, p=p: copy_runs(places, runs, programs=p, validate=False))
               for p in programs]
    if engines:
        copiers.append(("engines", lambda places, runs: copy_runs_dma(places, runs, validate=False)))
    print("GB/s on the device (a sleep kernel hides the host's table building), and in brackets as "
          "the host sees it (table built per call, as the cache does)")
    print(f"{'case':<8} {'dir':<4} {'MiB':>6} | {'copy_ GB/s':>10} | " +
          " | ".join(f"{name:>7} GB/s  share  (host)" for name, _ in copiers))
    side = torch.cuda.Stream()           # the copy engines' batch refuses the legacy default stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for name, (places, d2h, nbytes) in (("blocks", block_case(args.blocks, rng)),
                                            ("images", image_case(args.images, rng))):
            host = places[-1]
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            for direction, runs, peak_fn in (
                    ("D2H", d2h, lambda: host.copy_(dev, non_blocking=True)),
                    ("H2D", reverse(d2h), lambda: dev.copy_(host, non_blocking=True))):
                peak = nbytes / median_ms(peak_fn, stream=side) / 1e6
                row = []
                for _, copier in copiers:
                    def fn():
                        copier(places, runs)
                    gbs = nbytes / median_ms(fn, sleep_cycles=SLEEP_CYCLES, stream=side) / 1e6
                    wall = nbytes / median_ms(fn, stream=side) / 1e6
                    row.append(f"{gbs:>12.1f} {100 * gbs / peak:5.1f}% ({wall:5.1f})")
                print(f"{name:<8} {direction:<4} {nbytes / 2**20:6.0f} | {peak:10.1f} | " + " | ".join(row))
    # interference: matmuls on one stream while images are copied on another; a sleep holds
    # both streams until everything is enqueued, so only device time counts
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    places, d2h, _ = image_case(args.images, rng)
    compute, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def matmul_ms(beside=None):
        times = []
        for _ in range(8):
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            compute.wait_stream(torch.cuda.current_stream())
            copy_stream.wait_stream(torch.cuda.current_stream())
            if beside is not None:
                with torch.cuda.stream(copy_stream):
                    for _ in range(4):
                        beside()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(compute):
                start.record()
                for _ in range(4):
                    a @ a
                end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[1:])

    alone = matmul_ms()
    print(f"4 matmuls 8192^3 bf16 ({alone:.2f} ms alone), slower by:")
    print(f"  beside one idle block (a 1-thread sleep kernel): "
          f"{100 * (matmul_ms(lambda: torch.cuda._sleep(SLEEP_CYCLES // 10)) / alone - 1):+.1f} %")
    for name, copier in copiers:
        print(f"  while copying images, {name}: "
              f"{100 * (matmul_ms(lambda: copier(places, d2h)) / alone - 1):+.1f} %")

if __name__ == "__main__":
    main()
