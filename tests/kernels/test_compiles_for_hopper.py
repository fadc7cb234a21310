"""Our Triton kernels compile for an H200 (sm_90) on a machine without a GPU: Triton lowers them
to PTX and its bundled ptxas to a cubin, so an unsupported construct fails in CI, not on the GPU.
(The compiled kernels' results are tested on the GPU by the other files here.) A subprocess,
because the CPU test session runs Triton in interpreter mode."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hpc_radix.kernels import gdn_taps, host_copy, snapshot_copy

def build(fn, signature, constexprs, **options):
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    assert c.asm["cubin"], fn
    print("compiled", fn.__name__, constexprs)

build(host_copy._copy_items_kernel, {"anchor_ptr": "*i32", "items_ptr": "*i64", "n_items": "i32"},
      {"ELEMS_PER_UNIT": 4, "BLOCK": 4096}, num_warps=4)
build(snapshot_copy._copy_state_slots_kernel,
      {"anchor_ptr": "*i32", "meta_ptr": "*i64", "src_ptr": "*i64", "dst_ptr": "*i64"},
      {"N_TENSORS": 2, "ELEMS_PER_UNIT": 4, "BLOCK": 1024}, num_warps=4)
for taps in (True, False):
    build(gdn_taps._fwd_h_taps_kernel,
          {"k": "*bf16", "v": "*bf16", "w": "*bf16", "v_new": "*bf16", "g": "*fp32", "h": "*bf16",
           "initial_state": "*fp32", "initial_state_indices": "*i32", "stride_init_state": "i64",
           "cu_seqlens": "*i32", "chunk_offsets": "*i32", "chunk_slots": "*i32", "T": "i32"},
          {"H": 48, "Hg": 16, "K": 128, "V": 128, "BT": 64, "BV": gdn_taps.GDN_CHUNK_H_BV,
           "HAS_TAPS": taps},
          num_warps=gdn_taps.GDN_CHUNK_H_NUM_WARPS, num_stages=gdn_taps.GDN_CHUNK_H_NUM_STAGES)
build(gdn_taps._conv_taps_kernel,
      {"mixed": "*bf16", "conv": "*bf16", "rows": "*i64", "prev": "*i64", "from_prev": "*i1",
       "work": "*i64", "dst": "*i64", "conv_dim": "i32", "stride_mt": "i32", "stride_md": "i32",
       "stride_cs": "i32", "stride_cd": "i32", "stride_cw": "i32"},
      {"W": 3, "BLOCK_D": gdn_taps.CONV_TAPS_BLOCK_D}, num_warps=4)
'''


def test_the_kernels_compile_to_sm90_cubins():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("compiled") == 5, run.stdout
