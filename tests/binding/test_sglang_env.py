"""Smoke test of the SGLang 0.5.17 environment the binding builds on.

Imports and constructs, on CPU tensors, every SGLang class the hpc_radix binding
uses (pools, allocators, the stock radix caches, Req, ServerArgs, the cache
registry, the plugin loader and HookRegistry), and runs a trivial Triton kernel
under TRITON_INTERPRET=1. If the CPU install route (requirements/cpu-lock.txt)
misses a package or pins a wrong version, this file fails first, with the
import error in its output.

Everything uses device="cpu" and speculative_num_draft_tokens=None; the test
does not set SGLANG_USE_CPU_ENGINE.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from array import array

from hpc_radix.sglang_version import checkpoints, req_slots
import pytest

# Never reach for a model hub from this test (the model path is a local dir).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")

# one tiny config and GDN state shape for every binding test
from sglang_harness import FULL_LAYERS, MAMBA_LAYERS, TINY_CONFIG, _cache_params  # noqa: E402

DEVICE = "cpu"
PAGE = 4  # tokens per page in the paged allocator
KV_SIZE = 64  # tokens in the KV pool
REQS = 4  # request slots
MAMBA_SLOTS = 6  # recurrent-state slots
HEADS, HEAD_DIM = 2, 8




# --------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def env_server_args(tmp_path_factory):
    """ServerArgs from the CLI parser, published as the process-wide args.

    ServerArgs.__post_init__ reads the model's config.json, so a tiny local one
    is written (no hub access). MambaRadixCache reads get_server_args() while it
    is constructed. The previously published args (e.g. the session fixture of
    sglang_harness) are published again afterwards, so other modules see theirs.
    """
    from sglang.srt.server_args import (
        ServerArgs,
        get_global_server_args,
        prepare_server_args,
        set_global_server_args_for_scheduler,
    )

    try:
        previous = get_global_server_args()
    except Exception:  # nothing published yet
        previous = None

    model_dir = tmp_path_factory.mktemp("tiny-llama")
    (model_dir / "config.json").write_text(TINY_CONFIG)
    args = prepare_server_args(
        [
            "--model-path",
            str(model_dir),
            "--device",
            "cpu",
            "--page-size",
            str(PAGE),
            "--skip-tokenizer-init",
        ]
    )
    assert isinstance(args, ServerArgs)
    set_global_server_args_for_scheduler(args)
    yield args
    if previous is not None:
        set_global_server_args_for_scheduler(previous)



@pytest.fixture()
def hybrid_pools(env_server_args):
    """HybridReqToTokenPool (with its MambaPool) + HybridLinearKVPool + paged allocator."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import (
        HybridLinearKVPool,
        HybridReqToTokenPool,
        MambaPool,
    )

    req_pool = HybridReqToTokenPool(
        size=REQS,
        mamba_size=MAMBA_SLOTS,
        mamba_spec_state_size=REQS,
        max_context_len=128,
        device=DEVICE,
        enable_memory_saver=False,
        cache_params=_cache_params(),
        mamba_layer_ids=MAMBA_LAYERS,
        enable_mamba_extra_buffer=False,
        speculative_num_draft_tokens=None,
    )
    assert isinstance(req_pool.mamba_pool, MambaPool)
    kv_pool = HybridLinearKVPool(
        size=KV_SIZE,
        dtype=torch.bfloat16,
        page_size=PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        full_attention_layer_ids=FULL_LAYERS,
        device=DEVICE,
        mamba_pool=req_pool.mamba_pool,
        enable_memory_saver=False,
    )
    allocator = PagedTokenToKVPoolAllocator(
        size=KV_SIZE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        device=DEVICE,
        kvcache=kv_pool,
        need_sort=False,
    )
    return req_pool, kv_pool, allocator


# --------------------------------------------------------------------------
# tests


def test_server_args(env_server_args):
    if checkpoints():      # 0.5.23 retired get_global_server_args for the runtime context
        from sglang.srt.runtime_context import get_server_args as published
    else:
        from sglang.srt.server_args import get_global_server_args as published

    assert env_server_args.page_size == PAGE
    assert env_server_args.device == "cpu"
    assert published() is env_server_args
    # The registry's selector flag (--radix-cache-backend); our plugin registers under it.
    assert env_server_args.radix_cache_backend is None


def test_hybrid_pools_and_paged_allocator(hybrid_pools):
    req_pool, kv_pool, allocator = hybrid_pools
    mamba = req_pool.mamba_pool

    # MambaPool: one conv + one temporal tensor per linear layer, size + 1 slots
    # (slot 0 is padding), all on the CPU.
    assert mamba.size == MAMBA_SLOTS
    cache = mamba.mamba_cache
    assert cache.temporal.shape[:2] == (len(MAMBA_LAYERS), MAMBA_SLOTS + 1)
    assert cache.temporal.device.type == "cpu"
    assert req_pool.mamba_allocator.available_size() == MAMBA_SLOTS
    assert req_pool.available_size() == REQS

    # HybridLinearKVPool maps the global full-attention layer id to its local index.
    assert kv_pool.full_attention_layer_id_mapping == {FULL_LAYERS[0]: 0}
    k = kv_pool.get_key_buffer(FULL_LAYERS[0])
    assert k.device.type == "cpu"
    assert k.shape[-2:] == (HEADS, HEAD_DIM)

    # Paged allocator: KV_SIZE tokens in KV_SIZE / PAGE pages (page 0, the padding
    # page, is extra and never handed out).
    assert allocator.num_pages == KV_SIZE // PAGE
    assert allocator.available_size() == KV_SIZE
    got = allocator.alloc(2 * PAGE)
    assert got is not None and got.numel() == 2 * PAGE
    assert allocator.available_size() == KV_SIZE - 2 * PAGE
    # page-aligned: each page's tokens are consecutive, first token on a page boundary
    pages = got.view(2, PAGE)
    assert bool((pages[:, 0] % PAGE == 0).all())
    assert bool((pages[:, 1:] - pages[:, :-1] == 1).all())
    allocator.free(got)
    assert allocator.available_size() == KV_SIZE
    assert allocator.alloc(KV_SIZE + PAGE) is None


def test_token_allocator_and_req_to_token_pool():
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    kv = MHATokenToKVPool(
        size=32,
        page_size=1,
        dtype=torch.float16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=2,
        device=DEVICE,
        enable_memory_saver=False,
    )
    alloc = TokenToKVPoolAllocator(
        size=32, dtype=torch.float16, device=DEVICE, kvcache=kv, need_sort=False
    )
    assert alloc.available_size() == 32
    idx = alloc.alloc(5)
    assert idx.tolist() == [1, 2, 3, 4, 5]  # slot 0 is the padding slot
    assert alloc.available_size() == 27

    pool = ReqToTokenPool(
        size=3, max_context_len=16, device=DEVICE, enable_memory_saver=False
    )
    assert pool.available_size() == 3
    assert pool.req_to_token.shape == (4, 16)  # +1 padding row


def _make_req(rid: str, ids):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", ids),
        sampling_params=SamplingParams(max_new_tokens=4),
    )


def test_req_and_hybrid_alloc(hybrid_pools):
    req_pool, _, _ = hybrid_pools
    reqs = [_make_req("a", [1, 2, 3]), _make_req("b", [4, 5])]
    assert reqs[0].rid == "a" and list(reqs[0].origin_input_ids) == [1, 2, 3]
    got = req_pool.alloc(reqs)
    assert got is not None and len(got) == 2
    assert req_pool.available_size() == REQS - 2
    assert req_pool.mamba_allocator.available_size() == MAMBA_SLOTS - 2
    assert all(req_slots(r).mamba_pool_idx is not None for r in reqs)


def test_radix_caches_construct(hybrid_pools):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    req_pool, _, allocator = hybrid_pools

    plain = RadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=PAGE,
        )
    )
    assert plain.evictable_size() == 0 and plain.device.type == "cpu"
    # insert 10 tokens -> 2 full pages stored (page-aligned), a 9-token query
    # matches the first 2 pages (8 tokens) only.
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    kv = allocator.alloc(3 * PAGE)
    tokens = list(range(100, 110))
    plain.insert(InsertParams(key=RadixKey(array("q", tokens)), value=kv[:10]))
    assert plain.evictable_size() == 2 * PAGE
    hit = plain.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens[:9]))))
    if checkpoints():          # 0.5.23 answers with the prefix's length
        assert hit.device_prefix_len == 2 * PAGE
    else:
        assert hit.device_indices.tolist() == kv[: 2 * PAGE].tolist()

    pools = dict(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
                 page_size=PAGE, enable_mamba_extra_buffer=True)
    if not checkpoints():      # 0.5.23 serves hybrid models through UnifiedRadixCache only
        from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache

        assert MambaRadixCache(CacheInitParams(**pools)).supports_mamba()

    unified = UnifiedRadixCache(
        CacheInitParams(**pools, tree_components=(ComponentType.FULL, ComponentType.MAMBA)))
    assert unified.is_mamba_enabled


def test_registry_plugins_and_hooks():
    from sglang.srt.mem_cache import registry
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    name = "hpc-radix-env-smoke"
    if name not in registry.registered_radix_cache_backends():
        registry.register_radix_cache_backend(name, lambda ctx: None)
    assert registry.get_radix_cache_factory(name) is not None
    with pytest.raises(ValueError):
        registry.register_radix_cache_backend(name, lambda ctx: None)

    assert callable(load_plugins)
    # The project is installed with its entry point (scripts/install-cpu.sh step 5),
    # which is how load_plugins() finds it; it is not called here (no side effects).
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("hpc_radix") == "hpc_radix.binding.plugin:register", eps
    assert hasattr(HookRegistry, "register") and hasattr(HookRegistry, "apply_hooks")
    assert HookType.AROUND.value == "around"


def test_flashinfer_and_triton_versions():
    """The lock pins flashinfer 0.6.15.post1 (imports with torch's CUDA build, no GPU)
    and triton 3.6.0, the release the GPU host runs."""
    import flashinfer
    import triton

    assert flashinfer.__version__ == "0.6.15.post1"
    assert triton.__version__ == "3.6.0"
    assert torch.__version__.startswith("2.14.1")


def test_triton_interpreter_on_cpu():
    """A trivial Triton kernel on CPU tensors under TRITON_INTERPRET=1.

    Run in a subprocess: the interpreter flag is read when triton is imported.
    """
    code = textwrap.dedent(
        """
        import torch, triton, triton.language as tl

        @triton.jit
        def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask)
            y = tl.load(y_ptr + offs, mask=mask)
            tl.store(out_ptr + offs, x + y, mask=mask)

        n = 1000
        x = torch.arange(n, dtype=torch.int32)
        y = torch.full((n,), 7, dtype=torch.int32)
        out = torch.empty_like(x)
        add[(triton.cdiv(n, 256),)](x, y, out, n, BLOCK=256)
        assert torch.equal(out, x + 7), out
        print("TRITON_OK", triton.__version__)
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TRITON_OK" in res.stdout
