"""What the hybrid cache needs of SGLang's server arguments and of the cache build context:
unset choices made (64-token pages, the extra_buffer mamba strategy), unsupported features and
speculative forms refused with an error naming the flag, and the model and pool geometry checked
when a scheduler builds the cache. The plugin registers these as hooks (plugin.py)."""
from __future__ import annotations

import functools
import logging

from hpc_radix.errors import HybridConfigError
from hpc_radix.options import BLOCK_TOKENS, OPTIONS, check_options_from_env, raw_options_from_env

from hpc_radix import sglang_version

logger = logging.getLogger(__name__)

BACKEND = "hybrid"
PAGE_SIZE = BLOCK_TOKENS  # one SGLang page = one cache block
STRATEGY = "extra_buffer"


def check_build_context(ctx) -> None:
    """Refuse models and pool geometries the hybrid cache cannot serve."""
    arch = _architecture(ctx)
    problems = []
    if not ctx.is_hybrid_ssm:
        problems.append(
            f"needs a hybrid SSM model (Gated-DeltaNet + attention, e.g. Qwen3.5, Qwen3-Next); "
            f"{arch} is not one"
        )
    if ctx.is_hybrid_swa:
        problems.append(f"does not support hybrid sliding-window attention ({arch})")
    if ctx.disable_radix_cache:
        problems.append("the radix cache is disabled")
    if ctx.params.page_size != PAGE_SIZE:
        problems.append(f"needs {PAGE_SIZE}-token pages, the KV pool has page size {ctx.params.page_size}")
    if not ctx.params.enable_mamba_extra_buffer or ctx.params.enable_mamba_extra_buffer_lazy:
        problems.append(f"needs --mamba-radix-cache-strategy {STRATEGY}")
    if problems:
        raise HybridConfigError(f"--radix-cache {BACKEND}: " + "; ".join(problems))
    check_options_from_env()


def _architecture(ctx) -> str:
    archs = getattr(getattr(ctx.model_config, "hf_config", None), "architectures", None)
    return archs[0] if archs else "this model"


# ---------------------------------------------------------------------------
# ServerArgs.__post_init__ (every process that builds ServerArgs)
# ---------------------------------------------------------------------------

# (field, is it in use, how the user spells it); design §9 item 17 of the guide
_UNSUPPORTED = (
    ("enable_unified_memory", bool, lambda v: "--enable-unified-memory"),
    ("disaggregation_mode", lambda v: v not in (None, "null"), lambda v: f"--disaggregation-mode={v}"),
    ("enable_linear_replayssm", bool, lambda v: "--enable-linear-replayssm"),
    ("enable_linear_replayssm_spec", bool, lambda v: "--enable-linear-replayssm-spec"),
    ("enable_int8_mamba_checkpoint", bool, lambda v: "--enable-int8-mamba-checkpoint"),
    ("enable_streaming_session", bool, lambda v: "--enable-streaming-session"),
    ("enable_session_radix_cache", bool, lambda v: "--enable-session-radix-cache"),
    ("enable_page_major_kv_layout", bool, lambda v: "--enable-page-major-kv-layout"),
    ("disable_radix_cache", bool, lambda v: "--disable-radix-cache"),
    # the device tier evicts LRU (dead KV first), the host tier by GDSF (design §9)
    ("radix_eviction_policy", lambda v: v not in (None, "lru"),
     lambda v: f"--radix-eviction-policy={v}"),
    # --speculative-algorithm is checked once SGLang has resolved it (speculative_problems)
)


def speculates(algorithm) -> bool:
    """Whether ``--speculative-algorithm`` turns speculative decoding on."""
    return algorithm not in (None, "", "NONE")


def speculative_problems(server_args) -> list[str]:
    """What keeps SGLang's resolved speculative decoding from running with the hybrid cache,
    one phrase per flag ([] when it can). The MTP head (NEXTN, EAGLE) with one draft path, and
    a tracking interval at least twice the draft tokens: a tracked state is then never
    rewritten by the verify queued after it (overlap scheduling), so it can be a finished
    request's endpoint (binding/device/commits.py)."""
    algo = server_args.speculative_algorithm
    if not speculates(algo):
        return []
    problems = []
    if algo != "EAGLE":               # SGLang resolves NEXTN to EAGLE
        problems.append(f"--speculative-algorithm={algo} (NEXTN or EAGLE only)")
    if server_args.speculative_eagle_topk not in (None, 1):
        problems.append(f"--speculative-eagle-topk={server_args.speculative_eagle_topk} (1 only)")
    for field, flag in (("enable_multi_layer_eagle", "--enable-multi-layer-eagle"),
                        ("speculative_adaptive", "--speculative-adaptive"),
                        ("speculative_draft_window_size", "--speculative-draft-window-size")):
        if getattr(server_args, field, None):
            problems.append(flag)
    draft = server_args.speculative_num_draft_tokens or 0
    if server_args.mamba_track_interval < 2 * draft:
        problems.append(f"--mamba-track-interval={server_args.mamba_track_interval} (at least "
                        f"{2 * draft}: twice --speculative-num-draft-tokens)")
    return problems


def prepare_server_args(server_args) -> None:
    """BEFORE SGLang resolves the server arguments: the fields still hold what the user gave."""
    if server_args.radix_cache_backend != BACKEND:
        _warn_unused_environment()
        return
    if sglang_version.resolved_before(server_args):
        return
    untested = sglang_version.check()
    if untested:
        logger.warning("--radix-cache %s: %s", BACKEND, untested)
    _refuse_unsupported(server_args)
    check_options_from_env()
    sglang_version.fill_server_args(server_args, _choose_cache_layout, source="hpc_radix")
    if server_args.mamba_track_interval % PAGE_SIZE:
        raise HybridConfigError(
            f"--mamba-track-interval={server_args.mamba_track_interval}: --radix-cache {BACKEND} "
            f"needs a multiple of {PAGE_SIZE}"
        )


def _refuse_unsupported(server_args) -> None:
    refused = [
        spell(getattr(server_args, field))
        for field, in_use, spell in _UNSUPPORTED
        if in_use(getattr(server_args, field, None))
    ]
    if refused:
        raise HybridConfigError(
            f"{', '.join(refused)}: not supported with --radix-cache {BACKEND}"
        )


def _choose_cache_layout(server_args) -> None:
    _choose_page_size(server_args)
    _choose_mamba_strategy(server_args)


def _choose_page_size(server_args) -> None:
    if server_args.page_size is None:
        server_args.page_size = PAGE_SIZE
        logger.info("--radix-cache %s: using --page-size %d", BACKEND, PAGE_SIZE)
    elif server_args.page_size != PAGE_SIZE:
        raise HybridConfigError(
            f"--page-size={server_args.page_size}: --radix-cache {BACKEND} needs "
            f"--page-size {PAGE_SIZE} (or leave it unset)"
        )


def _choose_mamba_strategy(server_args) -> None:
    strategy = server_args.mamba_radix_cache_strategy
    if strategy == "auto":
        server_args.mamba_radix_cache_strategy = STRATEGY
        logger.info("--radix-cache %s: using --mamba-radix-cache-strategy %s", BACKEND, STRATEGY)
    elif strategy != STRATEGY:
        raise HybridConfigError(
            f"--mamba-radix-cache-strategy={strategy}: --radix-cache {BACKEND} needs "
            f"{STRATEGY} (or leave it on auto)"
        )


def check_resolved_server_args(result, server_args) -> None:
    """AFTER SGLang resolved the server arguments: its resolution must have kept our choices."""
    if server_args.radix_cache_backend != BACKEND:
        return
    if server_args.model_path.lower() in ("none", "dummy"):
        return  # SGLang resolves nothing for these
    resolved = functools.partial(sglang_version.resolved, server_args)
    if speculates(resolved("speculative_algorithm")) and sglang_version.checkpoints():
        raise HybridConfigError(
            f"--radix-cache {BACKEND} with --speculative-algorithm: not on SGLang "
            f"{sglang_version.installed()} yet (its draft model's KV pools reach the cache "
            f"another way); it runs on SGLang {sglang_version.gpu_tested()}")
    problems = speculative_problems(server_args)
    if problems:
        raise HybridConfigError(f"speculative decoding with --radix-cache {BACKEND}: "
                                f"not with {', '.join(problems)}")
    page_size, strategy = resolved("page_size"), resolved("mamba_radix_cache_strategy")
    if page_size != PAGE_SIZE or strategy != STRATEGY:
        raise HybridConfigError(
            f"--radix-cache {BACKEND}: SGLang resolved --page-size={page_size} and "
            f"--mamba-radix-cache-strategy={strategy} for this model; the hybrid cache needs "
            f"{PAGE_SIZE} and {STRATEGY}"
        )


def _warn_unused_environment() -> None:
    names = [spec.env for spec in OPTIONS if spec.name in raw_options_from_env()]
    if names:
        logger.warning(
            "%s set but --radix-cache is not %s: the hybrid options are ignored",
            ", ".join(names),
            BACKEND,
        )
