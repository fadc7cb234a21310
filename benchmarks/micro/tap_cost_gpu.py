#!/usr/bin/env python3
"""What zero-split taps add to a prefill pass, on Qwen3.5-27B's GDN shape (one GPU).

For one prefill batch (``--lens``, token counts of its sequences) this times the GDN chunk op
of ``--layers`` layers (16 key / 48 value heads of 128, fp32 state, bf16 conv state of
48*128 + 2*16*128 channels) with SGLang's kernel, then with 1, 4 and 8 taps captured in the
pass: taps on the chunk kernel's 64-token grid (conv window + in-kernel state store) and off it
(plus the batched partial-chunk call). Two clocks, CUDA events both: ``device`` has the GPU
sleep while the host enqueues, so it counts GPU work only; ``wall`` does not, so host launch
time counts too (in a server the other layers' GPU work hides most of it). The extra
milliseconds are what taps cost instead of the whole-model forward pass an exact split costs.

    python benchmarks/micro/tap_cost_gpu.py [--layers 48] [--lens 512,512,512,512,512,512,512,512] [--kernels]
"""
import argparse
import random
from collections import Counter

import torch
from gpu_timing import median_ms
from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule

from hpc_radix.kernels.gdn_taps import build_tap_tables, capture_conv_taps, chunk_gated_delta_rule_with_taps, copy_end_taps

HK, HV, D, W = 16, 48, 128, 3
CONV_DIM = HV * D + 2 * HK * D


SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time, longer than any host enqueue here


def elapsed_ms(fn, device_only=False):
    return median_ms(fn, warmup=5, sleep_cycles=SLEEP_CYCLES if device_only else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--lens", default="512," * 7 + "512")
    ap.add_argument("--taps", default="1,4,8")
    ap.add_argument("--kernels", action="store_true",
                    help="also GPU time per kernel (torch profiler): stock, no tap, one tap on and off the grid")
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    T, n = sum(lens), len(lens)
    dev = "cuda"
    q = torch.randn(1, T, HK, D, device=dev).to(torch.bfloat16)
    k = torch.randn(1, T, HK, D, device=dev).to(torch.bfloat16)
    v = torch.randn(1, T, HV, D, device=dev).to(torch.bfloat16)
    g = -torch.rand(1, T, HV, device=dev) * 0.5
    beta = torch.rand(1, T, HV, device=dev)
    mixed = torch.randn(T, CONV_DIM, device=dev).to(torch.bfloat16)
    slots = n + 9
    ssm = torch.zeros(args.layers, slots, HV, D, D, device=dev)
    conv = torch.zeros(args.layers, slots, CONV_DIM, W, device=dev).to(torch.bfloat16)
    starts = [sum(lens[:i]) for i in range(n)]
    cu = torch.tensor(starts + [T], dtype=torch.int32, device=dev)
    work = torch.arange(1, n + 1, dtype=torch.int32, device=dev)

    def stock_pass():
        for layer in range(args.layers):
            chunk_gated_delta_rule(q, k, v, g, beta, initial_state=ssm[layer], initial_state_indices=work,
                                   cu_seqlens=cu, head_first=False, use_qk_l2norm_in_kernel=True)

    def tapped_pass(taps):
        tables = build_tap_tables(starts, lens, taps, work, conv_width=W, device=dev)
        for layer in range(args.layers):
            capture_conv_taps(tables, mixed, conv[layer])
            chunk_gated_delta_rule_with_taps(q, k, v, g, beta, initial_state=ssm[layer],
                                             initial_state_indices=work, cu_seqlens=cu, tables=tables)
        copy_end_taps(tables, [conv, ssm])

    rng = random.Random(0)
    base = {clock: elapsed_ms(stock_pass, device_only=clock == "device") for clock in ("wall", "device")}
    print(f"GDN chunk op, {args.layers} layers, batch {n} x {lens[0]} tokens ({T}): stock "
          f"{base['device']:.2f} ms device, {base['wall']:.2f} ms wall")
    print("taps | grid | device ms | extra | wall ms | extra")
    cases = {"none": []}
    for count in (int(x) for x in args.taps.split(",")):
        for on_grid in (True, False):
            rows = [rng.randrange(n) for _ in range(count)]
            taps = sorted((r, _position(rng, lens[r], on_grid), n + 1 + i) for i, r in enumerate(rows))
            cases[f"{count} {'on' if on_grid else 'off'}"] = taps
            ms = {clock: elapsed_ms(lambda: tapped_pass(taps), device_only=clock == "device")
                  for clock in ("wall", "device")}
            print(f"{count:4d} | {'on ' if on_grid else 'off'}  | {ms['device']:9.2f} | "
                  f"{ms['device'] - base['device']:5.2f} | {ms['wall']:7.2f} | {ms['wall'] - base['wall']:5.2f}")
    ms = {clock: elapsed_ms(lambda: tapped_pass([]), device_only=clock == "device") for clock in ("wall", "device")}
    print(f"   0 | -    | {ms['device']:9.2f} | {ms['device'] - base['device']:5.2f} | "
          f"{ms['wall']:7.2f} | {ms['wall'] - base['wall']:5.2f}   (the hybrid cache's path, no tap in the pass)")
    if args.kernels:
        runs = {"stock": stock_pass, **{f"taps {name}": (lambda t=t: tapped_pass(t))
                                        for name, t in cases.items() if name in ("none", "1 on", "1 off")}}
        print_kernel_table({name: kernel_ms(fn) for name, fn in runs.items()})


def kernel_ms(fn, repeats: int = 5) -> Counter:
    """GPU milliseconds per kernel name for one call of ``fn`` (torch profiler, mean of
    ``repeats``)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    out = Counter()
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if us and event.device_type == torch.autograd.DeviceType.CUDA:
            out[event.key] += us / 1000 / repeats
    return out


def print_kernel_table(runs: dict) -> None:
    names = sorted({k for c in runs.values() for k in c}, key=lambda k: -max(c[k] for c in runs.values()))
    print("kernel ms per pass | " + " | ".join(runs))
    for name in names:
        print(f"{name[:60]:60s} | " + " | ".join(f"{c[name]:7.3f}" for c in runs.values()))
    print(f"{'total':60s} | " + " | ".join(f"{sum(c.values()):7.3f}" for c in runs.values()))


def _position(rng, length, on_grid):
    if on_grid:
        return 64 * rng.randrange(1, max(2, length // 64))
    while True:
        p = rng.randrange(1, length)
        if p % 64:
            return p


if __name__ == "__main__":
    main()
