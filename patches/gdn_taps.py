"""Zero-split taps: SGLang's GDN prefill pass captures the planned taps (kernels/gdn_taps.py).

Hooks through HookRegistry (no file edits), in the order a prefill pass meets them:
- ``ForwardBatch.init_new`` (AFTER): the batch is final (mixed decode rows included); the tree
  cache reserves a slot per tap of this pass (``HybridRadixCache.reserve_taps``), then notes
  the build (``HybridRadixCache.batch_built``, every batch: see binding/device/ids.py), and the
  plan rides on the ForwardBatch. A speculative draft model's passes are skipped: the
  target's pass of the same step is the build.
- ``GDNAttnBackend.init_forward_metadata`` (AFTER): the plan becomes device tables in the
  backend's forward metadata. The prefill CUDA-graph runner hands the layers a rebuilt
  ForwardBatch but builds this metadata from the real one, so the layers see the tables.
- ``GDNAttnBackend.forward_extend`` (AROUND): conv taps before the conv kernel overwrites the
  working slots, the tables handed to the kernel call of this layer (a context variable, set
  only for the duration of the layer), and after the last GDN layer of the pass the
  end-of-extend taps of every layer in one copy.
- ``TritonGDNKernel.extend`` (AROUND): the chunk kernel with taps when a layer has tables (every
  extend pass of the hybrid cache, taps or none: its chunk table comes from the host, where
  SGLang's call reads the lengths back and so waits for the pass before it on every prefill).
Warm-up and CUDA-graph capture batches carry no plan, so nothing happens for them.
"""
from __future__ import annotations

import contextvars

from hpc_radix.hooks import hooks_of

_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_GDN = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"
INIT_NEW_TARGET = f"{_FORWARD_BATCH}.init_new"
METADATA_TARGET = f"{_GDN}.init_forward_metadata"
EXTEND_TARGET = f"{_GDN}.forward_extend"
KERNEL_TARGET = "sglang.srt.layers.attention.linear.kernels.gdn_triton.TritonGDNKernel.extend"
TARGETS = (INIT_NEW_TARGET, METADATA_TARGET, EXTEND_TARGET, KERNEL_TARGET)

PLAN_ATTR = "hpc_taps"      # on the ForwardBatch (host plan) and the forward metadata (tables)
_layer_tables = contextvars.ContextVar("hpc_radix_layer_taps", default=None)


def _captures_taps(mode) -> bool:
    return mode.is_extend() and not mode.is_target_verify()


def _after_init_new(forward_batch, cls, batch, *args, **kwargs):
    runner = args[0] if args else kwargs.get("model_runner")
    if getattr(runner, "is_draft_worker", False):
        # a speculative draft's pass: the target's pass of the same step is the batch's build
        setattr(forward_batch, PLAN_ATTR, None)
        return forward_batch
    hooks = hooks_of(getattr(batch, "tree_cache", None))
    plan = None
    if hooks is not None and _captures_taps(forward_batch.forward_mode):
        # before the build is noted: a spare slot read now waits for the previous build's
        # event (the pass before the one in flight), not for the pass in flight
        plan = hooks.reserve_taps(batch)
    if hooks is not None:
        # every batch: ids written until now are settled after it; an extend's layers wait
        # for the host restores launched since the last build, each for its own bytes
        hooks.batch_built(forward_batch.forward_mode.name in ("EXTEND", "MIXED"))
    setattr(forward_batch, PLAN_ATTR, plan)
    return forward_batch


def _after_metadata(result, backend, forward_batch, *args, **kwargs):
    plan = getattr(forward_batch, PLAN_ATTR, None)
    tables = None
    if plan is not None:
        from hpc_radix.kernels.gdn_taps import build_tap_tables

        tables = build_tap_tables(plan.extend_starts, plan.extend_lens, plan.taps,
                                  backend.forward_metadata.mamba_cache_indices,
                                  conv_width=backend.conv_states_shape[-1], device=backend.device)
    setattr(backend.forward_metadata, PLAN_ATTR, tables)
    return result


def _around_forward_extend(orig, backend, *args, **kwargs):
    tables = getattr(backend.forward_metadata, PLAN_ATTR, None)
    if tables is None:
        return orig(backend, *args, **kwargs)
    from hpc_radix.kernels.gdn_taps import capture_conv_taps, copy_end_taps

    layer = kwargs["layer"] if "layer" in kwargs else args[0]
    pool = backend.req_to_token_pool
    if tables.conv_dst is not None:    # (the layer's cache view is a dozen tensor slices)
        mixed_qkv = kwargs["mixed_qkv"] if "mixed_qkv" in kwargs else args[2]
        capture_conv_taps(tables, mixed_qkv, pool.mamba2_layer_cache(layer.layer_id).conv[0])
    token = _layer_tables.set(tables)
    try:
        out = orig(backend, *args, **kwargs)
    finally:
        _layer_tables.reset(token)
    if layer.layer_id == max(pool.mamba_map):      # the pass's last GDN layer: every layer's
        cache = pool.mamba_pool.mamba_cache        # working state is final
        copy_end_taps(tables, [*cache.conv, cache.temporal])
    return out


def _around_kernel_extend(orig, kernel, q, k, v, g, beta, **kwargs):
    tables = _layer_tables.get()
    if tables is None:
        return orig(kernel, q, k, v, g, beta, **kwargs)
    from hpc_radix.kernels.gdn_taps import chunk_gated_delta_rule_with_taps

    return chunk_gated_delta_rule_with_taps(
        q, k, v, g, beta, initial_state=kwargs["ssm_states"],
        initial_state_indices=kwargs["cache_indices"], cu_seqlens=kwargs["query_start_loc"],
        tables=tables)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(INIT_NEW_TARGET, _after_init_new, HookType.AFTER)
    HookRegistry.register(METADATA_TARGET, _after_metadata, HookType.AFTER)
    HookRegistry.register(EXTEND_TARGET, _around_forward_extend, HookType.AROUND)
    HookRegistry.register(KERNEL_TARGET, _around_kernel_extend, HookType.AROUND)


def zero_split_path(option: str, model_runner) -> tuple[bool, str]:
    """Whether this scheduler's prefill passes can capture taps, and why (for the startup log).
    HookRegistry only logs a hook that failed to apply, so each is checked here."""
    if option == "off":
        return False, "--cache-zero-split off"
    from hpc_radix.patches.scheduler_hooks import unapplied

    missing = unapplied(TARGETS)
    if missing:
        return False, f"hooks not applied: {', '.join(missing)}"
    if model_runner is None:
        return False, "no model runner in this process"
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
    from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

    backend = getattr(model_runner.attn_backend, "linear_attn_backend", None)
    if not isinstance(backend, GDNAttnBackend):
        return False, f"linear attention backend {type(backend).__name__} is not GDN"
    kernel = backend.kernel_dispatcher.extend_kernel
    if not isinstance(kernel, TritonGDNKernel):
        return False, f"GDN prefill kernel {type(kernel).__name__} (zero-split needs the Triton one)"
    graphs = getattr(model_runner, "prefill_cuda_graph_runner", None)
    if getattr(graphs, "_is_full_backend", False):
        return False, "a full prefill CUDA graph captures the GDN op"
    cache = model_runner.req_to_token_pool.mamba_pool.mamba_cache
    if not all(t.is_contiguous() for t in (*cache.conv, cache.temporal)):
        return False, "the mamba pool is not contiguous"
    return True, "Triton GDN prefill kernel, hooks live"
