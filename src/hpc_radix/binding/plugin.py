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
4. BEFORE and AFTER hooks where SGLang resolves the server arguments
   (``ServerArgs.__post_init__``; ``resolve_once`` from 0.5.23, see
   sglang_version.MOVED; SGLang's own ``Engine`` loads plugins first so that such
   hooks fire, for the CLI and the Python API alike): server_args.py's choices
   and checks.

Whether the model is a hybrid-SSM one is known only when the scheduler builds
the cache: the factory checks it, with the pool geometry, before anything else.
"""

from __future__ import annotations

import argparse
import logging
import os

from hpc_radix import sglang_version
from hpc_radix.errors import HybridConfigError
from hpc_radix.options import OPTIONS, OptionSpec, help_text, parse_option

from .server_args import (
    BACKEND, check_build_context, check_resolved_server_args, prepare_server_args, speculates,
)

logger = logging.getLogger(__name__)

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
    resolution = sglang_version.target(f"{_SERVER_ARGS}.__post_init__")
    HookRegistry.register(resolution, prepare_server_args, HookType.BEFORE)
    HookRegistry.register(resolution, check_resolved_server_args, HookType.AFTER)
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
    """Build the hybrid cache (the class of the installed SGLang's cache contract) from SGLang's
    ``TreeCacheBuildContext``."""
    check_build_context(ctx)
    from hpc_radix.patches.state import STATE

    if not STATE.hooks_installed:
        raise HybridConfigError(f"--radix-cache {BACKEND}: the scheduler hooks of the hpc_radix "
                                "plugin were not installed (see the plugin loading error above)")
    from hpc_radix.patches.scheduler_hooks import DRAFT_TARGET, unapplied

    speculative = speculates(sglang_version.resolved(ctx.server_args, "speculative_algorithm"))
    if speculative and unapplied([DRAFT_TARGET]):
        # the cache learns the draft model's KV pool (and builds its host tier) there
        raise HybridConfigError(f"--radix-cache {BACKEND} with --speculative-algorithm: the "
                                f"hook on {DRAFT_TARGET} did not apply")
    try:
        from hpc_radix.binding.contract import cache_class
    except ImportError as err:
        raise ImportError(
            f"--radix-cache {BACKEND}: cannot import hpc_radix.binding.contract: {err}"
        ) from err
    return cache_class()(ctx)


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
        # the one way to the spawned schedulers (ServerArgs keeps only its own fields), which
        # resolve it with the rest (options.resolve_options); a path made absolute here
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
            help=f"{help_text(spec)} Needs --radix-cache {BACKEND}. Env: {spec.env}.",
        )


def _check_cli_namespace(cls, args: argparse.Namespace):
    given = [spec.flag for spec in OPTIONS if hasattr(args, _namespace_dest(spec))]
    if given and getattr(args, "radix_cache_backend", None) != BACKEND:
        raise HybridConfigError(
            f"{', '.join(given)}: only with --radix-cache {BACKEND} "
            f"(--radix-cache-backend is {getattr(args, 'radix_cache_backend', None)!r})"
        )


