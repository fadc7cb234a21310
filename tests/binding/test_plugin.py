"""The SGLang plugin: backend registration, command line, validation (real SGLang, CPU)."""

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang.srt.server_args")

from sglang.srt.mem_cache.registry import create_tree_cache, get_radix_cache_factory  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from hpc_radix import sglang_version  # noqa: E402
from hpc_radix.binding import plugin, server_args as server_checks  # noqa: E402
from hpc_radix.binding.plugin import HybridConfigError, hybrid_cache_factory  # noqa: E402
from hpc_radix.options import OPTIONS, HybridOptions, OptionError, options_from_env, resolve_options  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_qwen35_config():
    """The text-only Qwen3.5 config of tests/gpu/tiny_qwen.py (3 GDN + 1 attention layer)."""
    sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))
    try:
        from tiny_qwen import make_config
    finally:
        sys.path.pop(0)
    return make_config(n_tokens=259)   # its byte-level tokenizer: 256 bytes + 3 specials


@pytest.fixture(scope="module", autouse=True)
def registered():
    plugin.register()
    HookRegistry.apply_hooks()


@pytest.fixture(autouse=True)
def clean_hpc_environment():
    """The options' argparse actions write os.environ directly: restore it around each test."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("HPC_")}
    yield
    for key in [k for k in os.environ if k.startswith("HPC_")]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen35")
    (path / "config.json").write_text(json.dumps(tiny_qwen35_config()))
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def extra_buffer_platform():
    """From 0.5.23 SGLang refuses extra_buffer on a platform without mamba state snapshots,
    the CPU among them; the server arguments are resolved here as on a GPU platform."""
    if not sglang_version.checkpoints():
        yield
        return
    from sglang.srt.arg_groups import mamba_hook

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mamba_hook, "_platform_supports_mamba_cache_extra_buffer", lambda: True)
        yield


class Resolved:
    """Server arguments as SGLang resolved them: from 0.5.23 the fields keep the operator's
    input and the resolution is kept beside it."""

    def __init__(self, args):
        self.args = args

    def __getattr__(self, name):
        return sglang_version.resolved(self.args, name)


def parse(model_dir, *argv):
    args = prepare_server_args(["--model-path", model_dir, "--device", "cpu", "--skip-tokenizer-init", *argv])
    if sglang_version.checkpoints():
        args.resolve_once()          # 0.5.23's launcher resolves them after parsing
    return Resolved(args)


def resolved_in_scheduler(c=4):
    """What a spawned scheduler resolves: only the environment crosses the process boundary."""
    return options_from_env(max_running_requests=c)


# --- selecting the backend -------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [("--radix-cache", "hybrid"), ("--radix-cache=hybrid",), ("--radix-cache-backend", "hybrid")],
)
def test_hybrid_selects_64_token_pages_and_extra_buffer(model_dir, argv):
    args = parse(model_dir, *argv)
    assert args.radix_cache_backend == "hybrid"
    assert args.page_size == 64
    assert args.mamba_radix_cache_strategy == "extra_buffer"


@pytest.mark.skipif(not sglang_version.checkpoints(), reason="0.5.17 resolves at construction")
def test_a_resolved_record_is_left_alone_when_resolved_again(model_dir):
    """A scheduler process gets the launcher's resolved record and resolves it again (a no-op
    for SGLang): the plugin's checks and startup lines ran once, in the launcher."""
    args = parse(model_dir, "--radix-cache", "hybrid").args
    lines = []                 # (SGLang's parse replaces the root logger's handlers)
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("hpc_radix")
    logger.addHandler(handler)
    try:
        args.resolve_once()
    finally:
        logger.removeHandler(handler)
    assert lines == []
    assert [source for source, _ in args._resolved_overrides].count("hpc_radix") == 1


def test_explicit_page_size_64_and_extra_buffer_are_accepted(model_dir):
    args = parse(model_dir, "--radix-cache", "hybrid", "--page-size", "64",
                 "--mamba-radix-cache-strategy", "extra_buffer")
    assert (args.page_size, args.mamba_radix_cache_strategy) == (64, "extra_buffer")


def test_without_hybrid_nothing_changes(model_dir):
    args = parse(model_dir)
    assert args.radix_cache_backend is None
    assert args.page_size == 1
    if sglang_version.checkpoints():        # SGLang resolves auto itself; nothing of ours
        assert "hpc_radix" not in [source for source, _ in args.args._resolved_overrides]
    else:
        assert args.mamba_radix_cache_strategy == "auto"


def test_backend_is_registered():
    assert get_radix_cache_factory("hybrid") is hybrid_cache_factory


# --- refused configurations -------------------------------------------------------------


def test_other_page_size_is_refused(model_dir):
    with pytest.raises(HybridConfigError) as err:
        parse(model_dir, "--radix-cache", "hybrid", "--page-size", "16")
    assert str(err.value) == (
        "--page-size=16: --radix-cache hybrid needs --page-size 64 (or leave it unset)"
    )


@pytest.mark.parametrize(
    "strategy", ["no_buffer", "extra_buffer_lazy"],
)
def test_other_mamba_strategies_are_refused(model_dir, strategy):
    with pytest.raises(HybridConfigError) as err:
        parse(model_dir, "--radix-cache", "hybrid", "--mamba-radix-cache-strategy", strategy)
    assert str(err.value) == (
        f"--mamba-radix-cache-strategy={strategy}: --radix-cache hybrid needs extra_buffer "
        "(or leave it on auto)"
    )


def test_track_interval_must_be_page_aligned(model_dir):
    with pytest.raises(HybridConfigError, match=r"^--mamba-track-interval=100: .* multiple of 64$"):
        parse(model_dir, "--radix-cache", "hybrid", "--mamba-track-interval", "100")


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--enable-unified-memory"], "--enable-unified-memory"),
        (["--disaggregation-mode", "prefill"], "--disaggregation-mode=prefill"),
        (["--disaggregation-mode", "decode"], "--disaggregation-mode=decode"),
        (["--enable-linear-replayssm"], "--enable-linear-replayssm"),
        (["--enable-linear-replayssm-spec"], "--enable-linear-replayssm-spec"),
        (["--enable-int8-mamba-checkpoint"], "--enable-int8-mamba-checkpoint"),
        (["--enable-streaming-session"], "--enable-streaming-session"),
        (["--enable-session-radix-cache"], "--enable-session-radix-cache"),
        (["--enable-page-major-kv-layout"], "--enable-page-major-kv-layout"),
        (["--disable-radix-cache"], "--disable-radix-cache"),
        (["--radix-eviction-policy", "slru"], "--radix-eviction-policy=slru"),
    ],
)
def test_unsupported_combinations_are_refused(model_dir, argv, named):
    with pytest.raises(HybridConfigError) as err:
        parse(model_dir, "--radix-cache", "hybrid", *argv)
    assert str(err.value) == f"{named}: not supported with --radix-cache hybrid"


@pytest.mark.skipif(sglang_version.checkpoints(), reason="refused from SGLang 0.5.23 (below)")
def test_speculative_decoding_runs_with_the_mtp_head_and_one_draft_path(model_dir):
    """The MTP head (NEXTN / EAGLE) runs with one draft path, with or without overlap
    scheduling, and a tracking interval at least twice the draft tokens; anything else is
    refused, each flag named."""
    args = parse(model_dir, "--radix-cache", "hybrid", "--speculative-algorithm", "NEXTN")
    assert args.speculative_algorithm == "EAGLE" and args.speculative_eagle_topk == 1
    assert server_checks.speculative_problems(args) == []
    with pytest.raises(HybridConfigError) as err:
        parse(model_dir, "--radix-cache", "hybrid", "--speculative-algorithm", "NEXTN",
              "--attention-backend", "triton", "--speculative-eagle-topk", "2", "--speculative-num-steps", "3",
              "--speculative-num-draft-tokens", "4")
    assert str(err.value) == ("speculative decoding with --radix-cache hybrid: "
                              "not with --speculative-eagle-topk=2 (1 only)")
    # what a GPU server resolves by default, and a long draft (resolved ServerArgs are read-only)
    fields = ("speculative_algorithm", "speculative_eagle_topk", "speculative_num_draft_tokens",
              "mamba_track_interval", "enable_multi_layer_eagle", "speculative_adaptive",
              "speculative_draft_window_size")
    gpu = SimpleNamespace(**{f: getattr(args, f) for f in fields}, disable_overlap_schedule=False)
    gpu.speculative_num_draft_tokens = 200
    assert server_checks.speculative_problems(gpu) == [
        "--mamba-track-interval=256 (at least 400: twice --speculative-num-draft-tokens)"]
    gpu.speculative_algorithm = "NGRAM"
    assert server_checks.speculative_problems(gpu)[0] == "--speculative-algorithm=NGRAM (NEXTN or EAGLE only)"


@pytest.mark.skipif(not sglang_version.checkpoints(), reason="runs on SGLang before 0.5.23")
def test_speculative_decoding_is_refused_from_0_5_23_naming_the_release(model_dir):
    """Its draft model's KV pools reach the cache through another path, not yet ported."""
    with pytest.raises(HybridConfigError) as err:
        parse(model_dir, "--radix-cache", "hybrid", "--speculative-algorithm", "NEXTN")
    assert str(err.value) == (
        f"--radix-cache hybrid with --speculative-algorithm: not on SGLang "
        f"{sglang_version.installed()} yet (its draft model's KV pools reach the cache another "
        f"way); it runs on SGLang {', '.join(sglang_version.GPU_TESTED)}")


def test_several_unsupported_flags_are_named_together(model_dir):
    with pytest.raises(HybridConfigError) as err:
        parse(model_dir, "--radix-cache", "hybrid", "--enable-unified-memory", "--enable-streaming-session")
    assert str(err.value) == (
        "--enable-unified-memory, --enable-streaming-session: not supported with --radix-cache hybrid"
    )


def test_hybrid_options_without_the_backend_are_refused(model_dir):
    with pytest.raises(HybridConfigError) as err:
        parse(model_dir, "--host-cache-mib", "0", "--cache-tap-ladder", "8192")
    assert str(err.value) == (
        "--host-cache-mib, --cache-tap-ladder: only with --radix-cache hybrid "
        "(--radix-cache-backend is None)"
    )


def test_bad_option_value_names_the_flag(model_dir):
    with pytest.raises(OptionError) as err:
        parse(model_dir, "--radix-cache", "hybrid", "--cache-tap-ladder", "-5")
    assert str(err.value) == "--cache-tap-ladder=-5: must be a positive multiple of 64"


def test_bad_environment_value_is_refused_at_launch(model_dir, monkeypatch):
    monkeypatch.setenv("HPC_DEVICE_SNAPSHOT_SLOTS", "0")
    with pytest.raises(OptionError) as err:
        parse(model_dir, "--radix-cache", "hybrid")
    assert str(err.value) == (
        "--device-snapshot-slots=0 (from HPC_DEVICE_SNAPSHOT_SLOTS): must be an integer >= 1"
    )


def test_prefix_cache_file_without_host_tier_is_refused_at_launch(model_dir, tmp_path):
    path = tmp_path / "cache.bin"
    with pytest.raises(OptionError) as err:
        parse(model_dir, "--radix-cache", "hybrid", "--host-cache-mib", "0",
              "--prefix-cache-file", str(path))
    assert str(err.value) == f"--prefix-cache-file={path}: needs a host tier (--host-cache-mib is 0)"


# --- options reach the schedulers -------------------------------------------------------


def test_cli_options_reach_the_scheduler_environment(model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parse(model_dir, "--radix-cache", "hybrid",
          "--host-cache-mib", "1024", "--device-snapshot-slots", "7",
          "--cache-taps-per-request", "3", "--cache-tap-ladder", "8192",
          "--cache-tap-min-gap", "2048", "--cache-zero-split", "off",
          "--cache-settled-reads", "on", "--cache-coalesce", "on", "--prefix-cache-file", "cache.bin",
          "--host-write-threshold", "30")
    assert os.environ["HPC_PREFIX_CACHE_FILE"] == str(tmp_path / "cache.bin")  # absolute
    assert resolved_in_scheduler() == HybridOptions(
        host_cache_mib=1024, prefix_cache_file=str(tmp_path / "cache.bin"), cache_store_dir=None,
        cache_store_config=None, cache_store="off", cache_store_mib=65536, cache_store_wait_ms=1000,
        cache_store_sync_ms=0, cache_store_writer="process", device_snapshot_slots=7,
        cache_taps_per_request=3, cache_tap_ladder=8192, cache_tap_min_gap=2048,
        cache_zero_split="off", cache_settled_reads="on", cache_spare_pages=16,
        cache_coalesce="on", host_restore_overlap="on", host_prefetch="off", host_copy="auto",
        host_restore_wait="pass", host_write_threshold=30, host_cache_pin="startup")


@pytest.mark.parametrize("spec", OPTIONS, ids=lambda s: s.flag)
def test_each_option_alone_via_cli_and_via_environment(model_dir, tmp_path, spec):
    value = {"prefix_cache_file": str(tmp_path / "c.bin"), "cache_zero_split": "off",
             "cache_settled_reads": "on", "cache_coalesce": "on",
             "host_write_threshold": "64", "host_cache_pin": "on-demand",
             "host_restore_overlap": "off", "host_prefetch": "on",
             "host_copy": "kernel", "host_restore_wait": "layer",
             "cache_store_dir": str(tmp_path / "tier"), "cache_store": "off",
             "cache_store_writer": "threads",
             "cache_store_config": '{"master_server_address": "127.0.0.1:1", '
                                   '"metadata_server": "http://127.0.0.1:2/metadata"}',
             }.get(spec.name, "128")
    parse(model_dir, "--radix-cache", "hybrid", spec.flag, value)
    via_cli = resolved_in_scheduler()
    assert getattr(via_cli, spec.name) == (int(value) if value.isdigit() else value)

    del os.environ[spec.env]
    os.environ[spec.env] = value
    parse(model_dir, "--radix-cache", "hybrid")
    assert resolved_in_scheduler() == via_cli


def test_defaults_when_nothing_is_given(model_dir):
    parse(model_dir, "--radix-cache", "hybrid")
    assert resolved_in_scheduler(c=4) == resolve_options({}, max_running_requests=4)   # nothing leaked


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        prepare_server_args(["--help"])
    out = capsys.readouterr().out
    for flag in ["--radix-cache NAME", *(s.flag for s in OPTIONS), *(s.env for s in OPTIONS)]:
        assert flag in out


# --- the factory (scheduler side) -------------------------------------------------------


def build_context(*, hybrid_ssm=True, hybrid_swa=False, page_size=64, extra_buffer=True,
                  lazy=False, arch="Qwen3_5ForCausalLM"):
    return SimpleNamespace(
        server_args=SimpleNamespace(radix_cache_backend="hybrid"),
        params=SimpleNamespace(page_size=page_size, enable_mamba_extra_buffer=extra_buffer,
                               enable_mamba_extra_buffer_lazy=lazy),
        is_hybrid_ssm=hybrid_ssm,
        is_hybrid_swa=hybrid_swa,
        disable_radix_cache=False,
        model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch])),
        effective_chunked_prefill_size=8192,
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(max_running_requests=4)),
    )


def test_factory_refuses_a_model_without_recurrent_state(monkeypatch):
    if sglang_version.checkpoints():   # 0.5.23 routes by the published config's backend
        from sglang.srt.mem_cache import registry

        monkeypatch.setattr(registry, "get_memory", lambda: SimpleNamespace(radix_cache_backend="hybrid"))
    with pytest.raises(HybridConfigError) as err:
        create_tree_cache(build_context(hybrid_ssm=False, arch="LlamaForCausalLM"))
    assert str(err.value) == (
        "--radix-cache hybrid: needs a hybrid SSM model (Gated-DeltaNet + attention, "
        "e.g. Qwen3.5, Qwen3-Next); LlamaForCausalLM is not one"
    )


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"hybrid_swa": True}, "does not support hybrid sliding-window attention (Qwen3_5ForCausalLM)"),
        ({"page_size": 1}, "needs 64-token pages, the KV pool has page size 1"),
        ({"extra_buffer": False}, "needs --mamba-radix-cache-strategy extra_buffer"),
        ({"lazy": True}, "needs --mamba-radix-cache-strategy extra_buffer"),
    ],
)
def test_factory_refuses_unsupported_geometry(kwargs, problem):
    with pytest.raises(HybridConfigError) as err:
        hybrid_cache_factory(build_context(**kwargs))
    assert str(err.value) == f"--radix-cache hybrid: {problem}"


def test_factory_checks_the_environment_options(monkeypatch):
    monkeypatch.setenv("HPC_CACHE_TAP_MIN_GAP", "10")
    with pytest.raises(OptionError, match=r"^--cache-tap-min-gap=10 \(from HPC_CACHE_TAP_MIN_GAP\)"):
        hybrid_cache_factory(build_context())


def test_factory_refuses_speculative_decoding_where_the_draft_hook_did_not_apply(monkeypatch):
    """The cache learns the draft model's KV pool, and builds its host tier, in that hook."""
    from hpc_radix.patches.scheduler_hooks import DRAFT_TARGET

    ctx = build_context()
    ctx.server_args.speculative_algorithm = "EAGLE"
    monkeypatch.setattr(HookRegistry, "_patched", HookRegistry._patched - {DRAFT_TARGET})
    with pytest.raises(HybridConfigError, match="maybe_register_hicache_draft did not apply"):
        hybrid_cache_factory(ctx)
    monkeypatch.setattr(HookRegistry, "_patched", HookRegistry._patched | {DRAFT_TARGET})
    monkeypatch.setenv("HPC_CACHE_TAP_MIN_GAP", "10")             # the next check refuses
    with pytest.raises(OptionError, match="--cache-tap-min-gap=10"):
        hybrid_cache_factory(ctx)


def test_options_for_a_scheduler_of_the_context(monkeypatch):
    # what a scheduler of build_context() (4 running requests) derives
    monkeypatch.setenv("HPC_HOST_CACHE_MIB", "0")
    opts = options_from_env(max_running_requests=4)
    assert (opts.host_cache_mib, opts.device_snapshot_slots, opts.cache_taps_per_request,
            opts.cache_spare_pages, opts.host_restore_overlap) == (0, 6, 2, 4, "off")


def test_registration_imports_no_cache_code():
    code = (
        "import sys; from hpc_radix.binding.plugin import register; register(); "
        "from sglang.srt.mem_cache.registry import get_radix_cache_factory as g; "
        "print(g('hybrid') is not None, 'hpc_radix.binding.cache' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["True", "False"]


def test_entry_point_names_register():
    from importlib.metadata import entry_points

    ours = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "hpc_radix"]
    if not ours:
        pytest.skip("hpc_radix is not installed (no entry point metadata)")
    assert ours[0].value == "hpc_radix.binding.plugin:register"
    assert ours[0].load() is plugin.register


def test_restores_are_waited_for_by_layer_where_the_pools_and_the_pass_allow_it():
    """The choice between a wait per layer and one before the pass, over SGLang's real pools
    (the hooks applied): refused where a wait per layer cannot run, and asked for."""
    sys.path.insert(0, os.path.join(REPO, "tests", "binding"))
    try:
        from sglang_harness import make_pools
    finally:
        sys.path.pop(0)
    from sglang.srt.managers.cache_controller import LayerDoneCounter

    from hpc_radix.binding.host.transfers import restore_wait_path

    req_pool, kv_pool, _ = make_pools()
    pools = (kv_pool, req_pool)
    eager = SimpleNamespace(forward_stream=object(), prefill_cuda_graph_runner=None)
    assert restore_wait_path("layer", True, True, eager, pools) == (
        True, "copied in up to 4 parts of consecutive layers, a batched copy and an event each")
    assert restore_wait_path("layer", False, True, eager, pools) == (
        True, "copied in up to 4 parts of consecutive layers, a kernel launch and an event each")
    assert restore_wait_path("pass", True, True, eager, pools) == (
        False, "--host-restore-wait pass, the default")
    graphed = SimpleNamespace(forward_stream=object(),
                              prefill_cuda_graph_runner=SimpleNamespace(_is_full_backend=True))
    refusals = [(graphed, pools, "a full prefill CUDA graph runs the layers"),
                (SimpleNamespace(prefill_cuda_graph_runner=None), pools, "no forward stream")]
    kv_pool.register_layer_transfer_counter(LayerDoneCounter(4))      # HiCache's, say
    refusals.append((eager, pools, "HybridLinearKVPool has a layer transfer counter already"))
    for runner, with_pools, why in refusals:
        with pytest.raises(ValueError) as err:
            restore_wait_path("layer", True, True, runner, with_pools)
        assert str(err.value) == f"--host-restore-wait=layer: {why}"
    assert restore_wait_path("pass", True, True, graphed, pools)[0] is False


def test_the_scheduler_hooks_apply_to_sglang():
    from hpc_radix.patches import scheduler_hooks as hooks

    assert hooks.unapplied([hooks.NEXT_ROUND_TARGET, hooks.ADMIT_TARGET, hooks.ADD_ONE_TARGET,
                            hooks.ADD_CHUNKED_TARGET, hooks.IDLE_TARGET, hooks.DRAFT_TARGET]) == []


def test_zero_split_hooks_apply_to_sglangs_gdn_path():
    from hpc_radix.patches import gdn_taps

    assert set(gdn_taps.TARGETS) <= HookRegistry._patched     # every target exists in 0.5.17
    assert gdn_taps.zero_split_path("off", None) == (False, "--cache-zero-split off")
    assert gdn_taps.zero_split_path("auto", None) == (False, "no model runner in this process")


def test_a_newer_sglang_starts_with_a_warning_and_an_older_one_is_refused(model_dir, monkeypatch, capfd):
    """Through the ServerArgs hooks the plugin installs (SGLang's logging setup replaces the
    root logger's handlers, so the log is read from stderr)."""
    from hpc_radix import sglang_version

    monkeypatch.setattr(sglang_version, "installed", lambda: "0.9.0")
    args = parse(model_dir, "--radix-cache", "hybrid")
    assert args.radix_cache_backend == "hybrid" and "SGLang 0.9.0 is newer" in capfd.readouterr().err
    monkeypatch.setattr(sglang_version, "installed", lambda: "0.5.1")
    with pytest.raises(HybridConfigError, match="SGLang 0.5.1 is older"):
        parse(model_dir, "--radix-cache", "hybrid")
    parse(model_dir)                               # another cache: no word about versions
    assert "SGLang 0.5.1" not in capfd.readouterr().err
