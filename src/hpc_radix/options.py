"""Hybrid prefix cache options (design §14.2): one definition per option.

Each option has a CLI flag (added to SGLang's parser by the plugin), an ``HPC_*`` environment
variable (how the value reaches the spawned scheduler processes), a parser with its
validation, a default (fixed, or derived from the rest of the configuration) and the
combinations it refuses. The help text, ``docs/options.md`` and the startup log come from this
table; ``resolve_options`` turns raw values into a frozen ``HybridOptions`` with every value
effective, in table order (a derived default reads the options above it).

Pure Python: imports neither torch nor sglang (nor numpy: the plugin imports this module at
registration).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Mapping, Optional, Union

from .errors import OptionError

BLOCK_TOKENS = 64  # one SGLang page = one cache block (= hpc_radix.index's, checked by a test)

RawValue = Union[str, int, None]

__all__ = ["OptionError"]    # defined in errors.py, raised here


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a scheduler knows of its server when it resolves the options."""
    max_running_requests: int
    mamba_slots: Optional[int] = None     # SGLang's mamba pool (None: not known)


@dataclasses.dataclass(frozen=True)
class Default:
    """An option's default: ``derive(resolved, limits)``, where ``resolved`` holds the options
    above it in the table; ``text`` says it in the help."""
    text: str
    derive: Callable[[Mapping[str, Any], Limits], Any]


def fixed(value, text: Optional[str] = None) -> Default:
    return Default(text or ("none" if value is None else str(value)), lambda resolved, limits: value)


def with_host_tier(on, off, text: Optional[str] = None) -> Default:
    """``on`` with a host tier, ``off`` without."""
    return Default(text or f"{on} with a host tier, {off} without",
                   lambda resolved, limits: on if resolved["host_cache_mib"] > 0 else off)


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    name: str  # field of HybridOptions
    flag: str
    env: str
    metavar: str
    help: str
    parse: Callable[["OptionSpec", str], Union[int, str]]
    default: Default
    # the combinations refused: (resolved value, options above it) -> why, or None
    refuse: Callable[[Any, Mapping[str, Any]], Optional[str]] = lambda value, resolved: None


def _bad(spec: OptionSpec, text: object, reason: str, from_env: bool) -> OptionError:
    where = f" (from {spec.env})" if from_env else ""
    return OptionError(f"{spec.flag}={text}{where}: {reason}")


_INTEGER = re.compile(r"[+-]?[0-9]+")


def _integer(spec: OptionSpec, text: str) -> int:
    stripped = text.strip()
    if not _INTEGER.fullmatch(stripped):
        raise ValueError("not an integer")
    return int(stripped)


def _at_least(minimum: int, what: str) -> Callable[[OptionSpec, str], int]:
    def parse(spec: OptionSpec, text: str) -> int:
        value = _integer(spec, text)
        if value < minimum:
            raise ValueError(f"must be {what}")
        return value

    return parse


def _block_multiple(spec: OptionSpec, text: str) -> int:
    value = _integer(spec, text)
    if value <= 0 or value % BLOCK_TOKENS:
        raise ValueError(f"must be a positive multiple of {BLOCK_TOKENS}")
    return value


def _choice(*choices: str) -> Callable[[OptionSpec, str], str]:
    def parse(spec: OptionSpec, text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


def _percent(spec: OptionSpec, text: str) -> int:
    value = _integer(spec, text)
    if not 0 <= value <= 100:
        raise ValueError("must be a whole percentage from 0 to 100")
    return value


def _file_path(spec: OptionSpec, text: str) -> str:
    if not text.strip():
        raise ValueError("must be a file path")
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(path):
        raise ValueError("is a directory")
    if not os.path.isdir(os.path.dirname(path)):
        raise ValueError(f"parent directory {os.path.dirname(path)} does not exist")
    return path


def _directory(spec: OptionSpec, text: str) -> str:
    if not text.strip():
        raise ValueError("must be a directory")
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError("is not a directory")
    if not os.path.isdir(os.path.dirname(path)):
        raise ValueError(f"parent directory {os.path.dirname(path)} does not exist")
    return path


def _json_object(spec: OptionSpec, text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ValueError(f"not JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return json.dumps(value, sort_keys=True)


def _needs_host_tier(unless) -> Callable[[Any, Mapping[str, Any]], Optional[str]]:
    """Refuses any value but ``unless`` without a host tier."""
    def refuse(value, resolved) -> Optional[str]:
        if value != unless and resolved["host_cache_mib"] == 0:
            return "needs a host tier (--host-cache-mib is 0)"
        return None
    return refuse


def _snapshot_slots(resolved, limits: Limits) -> int:
    # every mamba slot beyond what running requests hold (a working slot and two tracking
    # slots each) can keep a snapshot
    running = limits.max_running_requests
    floor = running + (1 if resolved["host_cache_mib"] > 0 else 2)
    headroom = limits.mamba_slots - 3 * running if limits.mamba_slots is not None else 0
    return max(floor, headroom)


def _restore_overlap_refused(value, resolved) -> Optional[str]:
    why = _needs_host_tier("off")(value, resolved)
    if why is None and value == "on" and resolved["cache_settled_reads"] == "off":
        return "needs settled reads (--cache-settled-reads is off)"
    return why


def _store_refused(value, resolved) -> Optional[str]:
    if value == "off":
        return None
    if resolved["host_cache_mib"] == 0:
        return "needs a host tier (--host-cache-mib is 0): the shared tier is written from it"
    if resolved["prefix_cache_file"] is not None:
        return ("the shared tier keeps the host tier across restarts and crashes: drop "
                "--prefix-cache-file")
    if value == "file" and resolved["cache_store_dir"] is None:
        return "needs --cache-store-dir"
    if value == "mooncake" and resolved["cache_store_config"] is None:
        return ("needs --cache-store-config with Mooncake's master_server_address and "
                "metadata_server")
    return None


def _pin_refused(value, resolved) -> Optional[str]:
    if value != "startup" and resolved["prefix_cache_file"] is not None:
        return ("the --prefix-cache-file data is read into the host tier at startup: use "
                "--host-cache-pin startup")
    return None


OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec(
        "host_cache_mib", "--host-cache-mib", "HPC_HOST_CACHE_MIB", "MIB",
        "Pinned host tier of the hybrid prefix cache, in MiB per scheduler (0 = device only): "
        "with --tp N each rank pins this much for its shard of the heads, as --hicache-size does.",
        _at_least(0, "an integer >= 0"), fixed(8192),
    ),
    OptionSpec(
        "prefix_cache_file", "--prefix-cache-file", "HPC_PREFIX_CACHE_FILE", "PATH",
        "Keep the host tier across restarts in this file (needs a host tier).",
        _file_path, fixed(None), _needs_host_tier(None),
    ),
    OptionSpec(
        "cache_store_dir", "--cache-store-dir", "HPC_CACHE_STORE_DIR", "DIR",
        "The shared tier in this directory, on local disk or a shared filesystem: every state and "
        "block that reaches the host tier is written there in the background and read back on a "
        "miss, by this server after a restart or crash and by every server sharing the directory.",
        _directory, fixed(None),
    ),
    OptionSpec(
        "cache_store_config", "--cache-store-config", "HPC_CACHE_STORE_CONFIG", "JSON",
        "Mooncake Store for --cache-store mooncake, as SGLang's --hicache-storage-backend-extra-"
        "config names it: master_server_address, metadata_server, protocol, device_name, "
        "global_segment_size, local_hostname, and local_buffer_size (the client's own buffer; "
        "objects go straight between the store and the host tier's slabs).",
        _json_object, fixed(None),
    ),
    OptionSpec(
        "cache_store", "--cache-store", "HPC_CACHE_STORE", "{off,file,mooncake}",
        "The shared tier below the host tier (needs one): a directory (file) or Mooncake Store.",
        _choice("off", "file", "mooncake"),
        Default("file with --cache-store-dir, mooncake with --cache-store-config, else off",
                lambda r, limits: "file" if r["cache_store_dir"] else
                "mooncake" if r["cache_store_config"] else "off"),
        _store_refused,
    ),
    OptionSpec(
        "cache_store_mib", "--cache-store-mib", "HPC_CACHE_STORE_MIB", "MIB",
        "Bytes the file tier keeps in its directory, in MiB (the least recently used objects go "
        "first; servers sharing the directory share the budget).",
        _at_least(1, "an integer >= 1"), fixed(65536),
    ),
    OptionSpec(
        "cache_store_wait_ms", "--cache-store-wait-ms", "HPC_CACHE_STORE_WAIT_MS", "MS",
        "How long a request waits in the queue for the shared tier's answer and read-back before "
        "it is admitted without them (what arrives later serves the next request).",
        _at_least(0, "an integer >= 0"), fixed(1000),
    ),
    OptionSpec(
        "cache_store_sync_ms", "--cache-store-sync-ms", "HPC_CACHE_STORE_SYNC_MS", "MS",
        "How long the scheduler may wait in a round, in all, for read-backs from the shared tier, "
        "so that a request whose state the tier holds is admitted in the round it arrived (0: it "
        "waits in the queue for a later round, a pass or more).",
        _at_least(0, "an integer >= 0"), fixed(0),
    ),
    OptionSpec(
        "cache_store_writer", "--cache-store-writer", "HPC_CACHE_STORE_WRITER", "{process,threads}",
        "Who writes and reads back the file tier's objects: a process of their own, through the "
        "host slabs' shared memory (none of its checksums and file calls waits for the "
        "scheduler's GIL), or threads of the scheduler's process.",
        _choice("process", "threads"), fixed("process"),
    ),
    OptionSpec(
        "device_snapshot_slots", "--device-snapshot-slots", "HPC_DEVICE_SNAPSHOT_SLOTS", "N",
        "Recurrent-state snapshot slots on the device.",
        _at_least(1, "an integer >= 1"),
        Default("the mamba slots running requests do not hold, --max-mamba-cache-size - 3 x max "
                "running requests, at least max running requests + 1 with a host tier, + 2 "
                "without", _snapshot_slots),
    ),
    OptionSpec(
        "cache_taps_per_request", "--cache-taps-per-request", "HPC_CACHE_TAPS_PER_REQUEST", "N",
        "Most new state snapshots (taps) one request may publish.",
        _at_least(0, "an integer >= 0"), with_host_tier(8, 2),
    ),
    OptionSpec(
        "cache_tap_ladder", "--cache-tap-ladder", "HPC_CACHE_TAP_LADDER", "TOKENS",
        f"Spacing of ladder taps in tokens, a multiple of {BLOCK_TOKENS}: back from a prompt's "
        f"end, doubling.",
        _block_multiple, fixed(4096),
    ),
    OptionSpec(
        "cache_tap_min_gap", "--cache-tap-min-gap", "HPC_CACHE_TAP_MIN_GAP", "TOKENS",
        f"Smallest distance in tokens between a ladder tap and any other tap of a request, a "
        f"multiple of {BLOCK_TOKENS}.",
        _block_multiple, fixed(1024),
    ),
    OptionSpec(
        "cache_zero_split", "--cache-zero-split", "HPC_CACHE_ZERO_SPLIT", "{auto,off}",
        "Capture taps inside the GDN prefill pass (auto: where the Triton GDN prefill kernel "
        "runs) or split the prefill chunk at each exact tap (off).",
        _choice("auto", "off"), fixed("auto"),
    ),
    OptionSpec(
        "cache_settled_reads", "--cache-settled-reads", "HPC_CACHE_SETTLED_READS", "{on,off}",
        "Read page and slot ids written before the last batch build without waiting for the "
        "forward pass in flight, and hold a few spare ids ahead (on), or read them plainly (off).",
        _choice("on", "off"), fixed("on"),
    ),
    OptionSpec(
        "cache_spare_pages", "--cache-spare-pages", "HPC_CACHE_SPARE_PAGES", "N",
        "With settled reads: fewest free KV pages the cache holds ahead for the pages a batch's "
        "tail copies and host restores take without waiting for the pass in flight; more while "
        "batches take more: free pages up to a quarter of the pool, and a full pool evicts ahead "
        "for up to a sixteenth of it. Spares are device pages the cache does not fill.",
        _at_least(0, "an integer >= 0"), with_host_tier(16, 4),
    ),
    OptionSpec(
        "cache_coalesce", "--cache-coalesce", "HPC_CACHE_COALESCE", "{on,off}",
        "In-flight prefix coalescing: a request sharing a long new prompt prefix with one still "
        "prefilling waits, a bounded number of batch builds, for that one's snapshot there "
        "instead of prefilling it again (off until measured; needs zero-split taps, else the "
        "startup log says it is off).",
        _choice("on", "off"), fixed("off"),
    ),
    OptionSpec(
        "host_restore_overlap", "--host-restore-overlap", "HPC_HOST_RESTORE_OVERLAP", "{on,off}",
        "Start a host restore whose device pages and slot were all spares taken before the last "
        "batch build beside the forward pass in flight (on), or after it (off).",
        _choice("on", "off"),
        Default("on with a host tier and settled reads, else off",
                lambda r, limits: "on" if r["host_cache_mib"] > 0 and r["cache_settled_reads"] == "on" else "off"),
        _restore_overlap_refused,
    ),
    OptionSpec(
        "host_prefetch", "--host-prefetch", "HPC_HOST_PREFETCH", "{on,off}",
        "Prefetch for the blocked head (design §6.6): a request refused for want of pages copies "
        "the host-only blocks of its source into free and host-backed device pages while it "
        "waits, so its admission finds them on device (off: it did not lower the time to first "
        "token where measured; needs a host tier).",
        _choice("on", "off"), fixed("off"), _needs_host_tier("off"),
    ),
    OptionSpec(
        "host_copy", "--host-copy", "HPC_HOST_COPY", "{auto,copy-engine,kernel}",
        "What moves the host tier's bytes: the GPU's copy engines (one batched driver copy, no "
        "SM taken from the forward pass; needs a CUDA 12.8 driver) or the Triton copy kernel, "
        "which takes SMs from it and slows a concurrent matmul. auto: the copy engines where the "
        "driver has them.",
        _choice("auto", "copy-engine", "kernel"), fixed("auto"), _needs_host_tier("auto"),
    ),
    OptionSpec(
        "host_restore_wait", "--host-restore-wait", "HPC_HOST_RESTORE_WAIT", "{pass,layer}",
        "How the prefill pass waits for a host restore it reads: for all of it before the pass "
        "starts (pass), or at each layer only for the part of the restore that holds its bytes, "
        "the restore copied in a few parts of consecutive layers (layer, design §6.5; needs a "
        "host tier and a pass that runs its layers outside a full prefill CUDA graph).",
        _choice("pass", "layer"), fixed("pass"), _needs_host_tier("pass"),
    ),
    OptionSpec(
        "host_write_threshold", "--host-write-threshold", "HPC_HOST_WRITE_THRESHOLD", "PERCENT",
        "Start writing device content through to the host tier once the device cache is this "
        "full, in percent of its KV pages or snapshot slots, catching up on what it holds then; "
        "until the next flush every new snapshot and released path is written at once "
        "(0 = from the start).",
        _percent,
        # a file keeps only what is on host: write everything while serving
        Default("50, or 0 with --prefix-cache-file or a shared tier",
                lambda r, limits: 0 if r["prefix_cache_file"] is not None
                or r["cache_store"] != "off" else 50),
    ),
    OptionSpec(
        "host_cache_pin", "--host-cache-pin", "HPC_HOST_CACHE_PIN", "{startup,on-demand}",
        "When the host tier's memory is allocated and pinned, in the background: at startup, or "
        "once the device cache is first half as full as --host-write-threshold asks (on-demand: "
        "no memory is locked while the device has room; not with --prefix-cache-file, whose data "
        "is read at startup).",
        _choice("startup", "on-demand"), fixed("startup"), _pin_refused,
    ),
)
OPTIONS_BY_NAME: dict[str, OptionSpec] = {spec.name: spec for spec in OPTIONS}


def parse_option(name: str, value: RawValue, *, from_env: bool = False):
    """Parse and check one raw value; None stays None (option not given)."""
    spec = OPTIONS_BY_NAME[name]
    if value is None:
        return None
    try:
        return spec.parse(spec, str(value))
    except ValueError as err:
        raise _bad(spec, value, str(err), from_env) from None


@dataclasses.dataclass(frozen=True)
class HybridOptions:
    """Every hybrid option with its effective value (fields in the table's order)."""

    host_cache_mib: int
    prefix_cache_file: Optional[str]
    cache_store_dir: Optional[str]
    cache_store_config: Optional[str]
    cache_store: str
    cache_store_mib: int
    cache_store_wait_ms: int
    cache_store_sync_ms: int
    cache_store_writer: str
    device_snapshot_slots: int
    cache_taps_per_request: int
    cache_tap_ladder: int
    cache_tap_min_gap: int
    cache_zero_split: str
    cache_settled_reads: str
    cache_spare_pages: int
    cache_coalesce: str
    host_restore_overlap: str
    host_prefetch: str
    host_copy: str
    host_restore_wait: str
    host_write_threshold: int
    host_cache_pin: str

    @property
    def host_tier(self) -> bool:
        return self.host_cache_mib > 0

    @property
    def host_cache_bytes(self) -> int:
        return self.host_cache_mib << 20

    def describe(self) -> str:
        """Every option in force, as its flag and value (the startup log's line)."""
        values = []
        for spec in OPTIONS:
            value = getattr(self, spec.name)
            values.append(f"{spec.flag} {'none' if value is None else value}")
        return "hybrid prefix cache options in force: " + ", ".join(values)


def _parsed(raw: Mapping[str, RawValue], from_env: bool) -> dict:
    unknown = set(raw) - set(OPTIONS_BY_NAME)
    if unknown:
        raise KeyError(f"unknown hybrid options: {sorted(unknown)}")
    return {
        spec.name: parse_option(spec.name, raw.get(spec.name), from_env=from_env)
        for spec in OPTIONS
    }


def resolve_options(
    raw: Mapping[str, RawValue],
    *,
    max_running_requests: int,
    from_env: bool = False,
    mamba_slots: Optional[int] = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> HybridOptions:
    """Derive every unset value (design §14.2) and check the combination: the one place the
    cache's effective options are decided.

    ``raw`` maps option names to strings or ints; a missing key or None means
    "not given". ``mamba_slots``: the size of SGLang's mamba pool (None: not known, the
    snapshot slots take the floor). The TP and DP ranks name this scheduler's cache file.
    """
    if max_running_requests < 1:
        raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
    given = _parsed(raw, from_env)
    limits = Limits(max_running_requests, mamba_slots)
    resolved: dict[str, Any] = {}
    for spec in OPTIONS:
        value = given[spec.name]
        if value is None:
            value = spec.default.derive(resolved, limits)
        why = spec.refuse(value, resolved)
        if why is not None:
            raise _bad(spec, value, why, from_env=False)
        resolved[spec.name] = value
    resolved["prefix_cache_file"] = rank_file(resolved["prefix_cache_file"], tp_rank=tp_rank,
                                              tp_size=tp_size, dp_rank=dp_rank, dp_size=dp_size)
    return HybridOptions(**resolved)


def rank_file(path: Optional[str], *, tp_rank: int, tp_size: int, dp_rank: int,
              dp_size: int) -> Optional[str]:
    """The cache file of one scheduler: each data-parallel and tensor-parallel rank keeps its
    own host tier, so its own file (``PATH.dpN``, ``PATH.tpK``, ``PATH.dpN.tpK``)."""
    if not path:
        return path
    if dp_size > 1:
        path = f"{path}.dp{dp_rank}"
    if tp_size > 1:
        path = f"{path}.tp{tp_rank}"
    return path


def raw_options_from_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The hybrid options set in the environment, by option name."""
    environ = os.environ if environ is None else environ
    return {spec.name: environ[spec.env] for spec in OPTIONS if spec.env in environ}


def options_from_env(
    *,
    max_running_requests: int,
    environ: Optional[Mapping[str, str]] = None,
) -> HybridOptions:
    """Resolve the options as a scheduler process sees them (``HPC_*`` variables)."""
    return resolve_options(
        raw_options_from_env(environ),
        max_running_requests=max_running_requests,
        from_env=True,
    )


def check_options_from_env(environ: Optional[Mapping[str, str]] = None) -> None:
    """Check what can be checked before the scheduler knows its limits."""
    options_from_env(max_running_requests=1, environ=environ)


def help_text(spec: OptionSpec) -> str:
    """The option's help: what it does and its default."""
    return f"{spec.help} Default: {spec.default.text}."


# Diagnostic switches (environment only, never flags): name -> (variable, on unless set to "0"?).
# docs/operations.md says what each does; read them through ``diagnostic`` alone.
DIAGNOSTICS = {
    "full_check": ("HPC_CACHE_FULL_CHECK", False),
    "profile": ("HPC_CACHE_PROFILE", False),
    "scheduler_phases": ("HPC_SCHEDULER_PHASES", False),
    "sync_census": ("HPC_SYNC_CENSUS", False),
    "snapshot_kernel": ("HPC_SNAPSHOT_KERNEL", True),
    "tp_check": ("HPC_TP_CHECK", False),
}


def diagnostic(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether diagnostic switch ``name`` (a key of DIAGNOSTICS) is on."""
    env, default = DIAGNOSTICS[name]
    value = (os.environ if environ is None else environ).get(env, "")
    return default if value == "" else value != "0"


def options_markdown() -> str:
    """docs/options.md: one row per option, from the table above (``python -m
    hpc_radix.options`` prints it; a test keeps the file equal to it)."""
    rows = ["# Options of `--radix-cache hybrid`", "",
            "Generated from `src/hpc_radix/options.py` by `python -m hpc_radix.options`; "
            "`python -m sglang.launch_server --help` shows the same text. Each flag can be "
            "given as its environment variable instead; the startup log lists every value in "
            "force.", "",
            "| flag | environment variable | value | default | what it does |",
            "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{s.flag}` | `{s.env}` | {s.metavar} | {s.default.text} | {s.help.replace('|', '/')} |"
             for s in OPTIONS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(options_markdown(), end="")
