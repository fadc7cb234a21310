"""SGLang entry point (group ``sglang.srt.plugins``): the ``hybrid`` radix-cache backend.

``register()`` runs in every SGLang process through ``load_plugins()`` (the
launcher before it parses the command line, each scheduler before it builds its
cache). It registers, in this order:

1. the backend ``hybrid``, whose factory imports ``HybridRadixCache`` only when
   a scheduler builds its cache, so nothing at registration can fail and hide
   the backend behind SGLang's "not registered" error;
2. an AFTER hook on ``ServerArgs.add_cli_args``: an exact ``--radix-cache``
   alias of ``--radix-cache-backend`` and the hybrid options. Each option is
   validated when parsed and written to its ``HPC_*`` environment variable,
   which the spawned schedulers inherit (``ServerArgs`` only keeps its own
   fields). The variables also work alone;
3. a BEFORE hook on ``ServerArgs.from_cli_args``, which sees the parsed
   namespace: hybrid options without the hybrid backend are refused;
4. BEFORE and AFTER hooks on ``ServerArgs.__post_init__`` (SGLang's own
   ``Engine`` loads plugins first so that such hooks fire, for the CLI and the
   Python API alike). Before the resolution runs, the fields are still plain
   inputs: unset ``--page-size`` becomes 64, ``auto`` mamba strategy becomes
   ``extra_buffer``, and unsupported combinations are refused. After it, the
   resolved values are checked again.

Whether the model is a hybrid-SSM one is known only when the scheduler builds
the cache: the factory checks it, with the pool geometry, before anything else.
"""

from __future__ import annotations

import argparse
import logging
import os

from hpc_radix.errors import HybridConfigError
from hpc_radix.options import (
    BLOCK_TOKENS,
    OPTIONS,
    OptionSpec,
    check_options_from_env,
    parse_option,
    raw_options_from_env,
)

logger = logging.getLogger(__name__)

BACKEND = "hybrid"
PAGE_SIZE = BLOCK_TOKENS  # one SGLang page = one cache block
STRATEGY = "extra_buffer"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"

_registered = False


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def register() -> None:
    """Entry point: register the backend first, then the command-line hooks."""
    global _registered
    if _registered:
        return
    _register_backend()
    _register_hooks()
    _registered = True


def _register_backend() -> None:
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    if get_radix_cache_factory(BACKEND) is None:
        register_radix_cache_backend(BACKEND, hybrid_cache_factory)


def _register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_SERVER_ARGS}.add_cli_args", _add_cli_args, HookType.AFTER)
    HookRegistry.register(f"{_SERVER_ARGS}.from_cli_args", _check_cli_namespace, HookType.BEFORE)
    HookRegistry.register(f"{_SERVER_ARGS}.__post_init__", _prepare_server_args, HookType.BEFORE)
    HookRegistry.register(f"{_SERVER_ARGS}.__post_init__", _check_resolved_server_args, HookType.AFTER)
    from hpc_radix.patches import (batch_syncs, decode_pages, gdn_taps, scheduler_hooks,
                                   scheduler_phases, state_copy)

    scheduler_hooks.install()
    state_copy.install()
    gdn_taps.install()
    batch_syncs.install()
    decode_pages.install()
    scheduler_phases.install()        # diagnostics, any cache: only with HPC_SCHEDULER_PHASES


# ---------------------------------------------------------------------------
# The factory (scheduler process)
# ---------------------------------------------------------------------------


def hybrid_cache_factory(ctx):
    """Build ``HybridRadixCache`` from SGLang's ``TreeCacheBuildContext``."""
    check_build_context(ctx)
    from hpc_radix.patches.state import STATE

    if not STATE.hooks_installed:
        raise HybridConfigError(f"--radix-cache {BACKEND}: the scheduler hooks of the hpc_radix "
                                "plugin were not installed (see the plugin loading error above)")
    from hpc_radix.patches.scheduler_hooks import DRAFT_TARGET, unapplied

    if speculates(getattr(ctx.server_args, "speculative_algorithm", None)) and unapplied([DRAFT_TARGET]):
        # the cache learns the draft model's KV pool (and builds its host tier) there
        raise HybridConfigError(f"--radix-cache {BACKEND} with --speculative-algorithm: the "
                                f"hook on {DRAFT_TARGET} did not apply")
    try:
        from hpc_radix.binding.cache import HybridRadixCache
    except ImportError as err:
        raise ImportError(
            f"--radix-cache {BACKEND}: cannot import hpc_radix.binding.cache.HybridRadixCache: {err}"
        ) from err
    return HybridRadixCache(ctx)


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
# Command line (launcher process)
# ---------------------------------------------------------------------------


def _namespace_dest(spec: OptionSpec) -> str:
    return f"hpc_{spec.name}"


class _EnvOptionAction(argparse.Action):
    """Check one hybrid option and hand it to the schedulers through its env var."""

    def __init__(self, option_strings, dest, spec: OptionSpec, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.spec = spec

    def __call__(self, parser, namespace, values, option_string=None):
        value = parse_option(self.spec.name, values)  # OptionError names the flag
        os.environ[self.spec.env] = str(value)
        setattr(namespace, self.dest, value)


def _add_cli_args(result, parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--radix-cache",
        dest="radix_cache_backend",
        default=argparse.SUPPRESS,
        metavar="NAME",
        help=f"Alias of --radix-cache-backend; '{BACKEND}' selects the hybrid prefix cache "
        "(hpc_radix) for hybrid Gated-DeltaNet models.",
    )
    for spec in OPTIONS:
        parser.add_argument(
            spec.flag,
            dest=_namespace_dest(spec),
            action=_EnvOptionAction,
            spec=spec,
            default=argparse.SUPPRESS,
            metavar=spec.metavar,
            help=f"{spec.help} Needs --radix-cache {BACKEND}. Env: {spec.env}.",
        )


def _check_cli_namespace(cls, args: argparse.Namespace):
    given = [spec.flag for spec in OPTIONS if hasattr(args, _namespace_dest(spec))]
    if given and getattr(args, "radix_cache_backend", None) != BACKEND:
        raise HybridConfigError(
            f"{', '.join(given)}: only with --radix-cache {BACKEND} "
            f"(--radix-cache-backend is {getattr(args, 'radix_cache_backend', None)!r})"
        )


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
    request's endpoint (binding/commits.py)."""
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


def _prepare_server_args(server_args) -> None:
    """BEFORE ``__post_init__``: the fields still hold what the user gave."""
    if server_args.radix_cache_backend != BACKEND:
        _warn_unused_environment()
        return
    _refuse_unsupported(server_args)
    check_options_from_env()
    _choose_page_size(server_args)
    _choose_mamba_strategy(server_args)
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


def _check_resolved_server_args(result, server_args) -> None:
    """AFTER ``__post_init__``: SGLang's resolution must have kept our choices."""
    if server_args.radix_cache_backend != BACKEND:
        return
    if server_args.model_path.lower() in ("none", "dummy"):
        return  # SGLang resolves nothing for these
    problems = speculative_problems(server_args)
    if problems:
        raise HybridConfigError(f"speculative decoding with --radix-cache {BACKEND}: "
                                f"not with {', '.join(problems)}")
    if server_args.page_size != PAGE_SIZE or server_args.mamba_radix_cache_strategy != STRATEGY:
        raise HybridConfigError(
            f"--radix-cache {BACKEND}: SGLang resolved --page-size={server_args.page_size} and "
            f"--mamba-radix-cache-strategy={server_args.mamba_radix_cache_strategy} for this "
            f"model; the hybrid cache needs {PAGE_SIZE} and {STRATEGY}"
        )


def _warn_unused_environment() -> None:
    names = [spec.env for spec in OPTIONS if spec.name in raw_options_from_env()]
    if names:
        logger.warning(
            "%s set but --radix-cache is not %s: the hybrid options are ignored",
            ", ".join(names),
            BACKEND,
        )
