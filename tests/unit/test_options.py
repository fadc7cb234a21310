"""hpc_radix.options: derived defaults, validation and error texts (design §14.2, §5.5)."""

import os
import re
import subprocess
import sys

import pytest

from hpc_radix.options import (
    OPTIONS,
    HybridOptions,
    OptionError,
    check_options_from_env,
    options_from_env,
    parse_option,
    raw_options_from_env,
    resolve_options,
)


def resolve(raw=None, c=4):
    return resolve_options(raw or {}, max_running_requests=c)


DEFAULTS = dict(
    host_cache_mib=8192,
    prefix_cache_file=None,
    cache_store_dir=None,
    cache_store_config=None,
    cache_store="off",
    cache_store_mib=65536,
    cache_store_wait_ms=1000,
    cache_store_sync_ms=0,
    cache_store_writer="process",
    device_snapshot_slots=5,
    cache_taps_per_request=8,
    cache_tap_ladder=4096,
    cache_tap_min_gap=1024,
    cache_zero_split="auto",
    cache_settled_reads="on",
    cache_spare_pages=16,
    cache_coalesce="off",
    host_restore_overlap="on",
    host_prefetch="off",
    host_copy="auto",
    host_restore_wait="pass",
    host_write_threshold=50,
    host_cache_pin="startup",
)


def test_defaults_with_host_tier():
    assert resolve(c=4) == HybridOptions(**DEFAULTS)


def test_each_default_is_said_in_the_help_and_on_the_options_page():
    """The default lives in the option's spec; the help text and docs/options.md say it from
    there (a fixed default as its value)."""
    from hpc_radix.options import help_text, options_markdown

    page = options_markdown()
    for spec in OPTIONS:
        assert help_text(spec).endswith(f"Default: {spec.default.text}.")
        assert f"| {spec.default.text} |" in page
        if spec.name in ("host_cache_mib", "cache_tap_ladder", "cache_tap_min_gap", "cache_zero_split",
                         "cache_settled_reads", "cache_coalesce", "host_prefetch", "host_copy",
                         "host_restore_wait", "host_cache_pin"):
            assert spec.default.text == str(DEFAULTS[spec.name]), spec.flag


def test_defaults_without_host_tier():
    opts = resolve({"host_cache_mib": "0"}, c=4)
    assert (opts.host_cache_mib, opts.device_snapshot_slots, opts.cache_taps_per_request) == (0, 6, 2)
    assert opts.cache_spare_pages == 4
    assert not opts.host_tier and opts.host_cache_bytes == 0


def test_given_values_win_over_defaults():
    opts = resolve(
        {
            "host_cache_mib": "1024",
            "device_snapshot_slots": 3,
            "cache_taps_per_request": "0",
            "cache_tap_ladder": "128",
            "cache_tap_min_gap": " 64 ",
        },
        c=16,
    )
    assert (opts.host_cache_mib, opts.device_snapshot_slots, opts.cache_taps_per_request) == (1024, 3, 0)
    assert (opts.cache_tap_ladder, opts.cache_tap_min_gap) == (128, 64)
    assert opts.host_cache_bytes == 1024 << 20


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("cache_tap_ladder", "-5", "--cache-tap-ladder=-5: must be a positive multiple of 64"),
        ("cache_tap_ladder", "100", "--cache-tap-ladder=100: must be a positive multiple of 64"),
        ("cache_tap_ladder", "0", "--cache-tap-ladder=0: must be a positive multiple of 64"),
        ("cache_tap_min_gap", "1000", "--cache-tap-min-gap=1000: must be a positive multiple of 64"),
        ("host_cache_mib", "-1", "--host-cache-mib=-1: must be an integer >= 0"),
        ("host_cache_mib", "8k", "--host-cache-mib=8k: not an integer"),
        ("host_cache_mib", "1.5", "--host-cache-mib=1.5: not an integer"),
        ("host_cache_mib", "", "--host-cache-mib=: not an integer"),
        ("device_snapshot_slots", "0", "--device-snapshot-slots=0: must be an integer >= 1"),
        ("device_snapshot_slots", "two", "--device-snapshot-slots=two: not an integer"),
        ("cache_taps_per_request", "-1", "--cache-taps-per-request=-1: must be an integer >= 0"),
        ("prefix_cache_file", "", "--prefix-cache-file=: must be a file path"),
        ("host_write_threshold", "101", "--host-write-threshold=101: must be a whole percentage from 0 to 100"),
        ("host_write_threshold", "-1", "--host-write-threshold=-1: must be a whole percentage from 0 to 100"),
        ("host_write_threshold", "50%", "--host-write-threshold=50%: not an integer"),
        ("host_cache_pin", "lazy", "--host-cache-pin=lazy: must be one of startup, on-demand"),
        ("cache_spare_pages", "-1", "--cache-spare-pages=-1: must be an integer >= 0"),
    ],
)
def test_bad_values_name_flag_and_value(name, value, message):
    with pytest.raises(OptionError) as err:
        resolve({name: value})
    assert str(err.value) == message
    assert isinstance(err.value, ValueError)


def test_prefix_cache_file_resolved_to_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve({"prefix_cache_file": "cache.bin"}).prefix_cache_file == str(tmp_path / "cache.bin")


def test_each_data_and_tensor_parallel_rank_has_its_own_cache_file(tmp_path):
    path = str(tmp_path / "cache")

    def file(**ranks):
        return resolve_options({"prefix_cache_file": path}, max_running_requests=4,
                               **ranks).prefix_cache_file
    assert file() == path
    assert file(dp_rank=1, dp_size=2) == path + ".dp1"
    assert file(tp_rank=3, tp_size=4) == path + ".tp3"
    assert file(dp_rank=1, dp_size=2, tp_rank=0, tp_size=2) == path + ".dp1.tp0"


def test_snapshot_slots_default_to_the_mamba_slots_running_requests_leave():
    def slots(mamba_slots, raw=None):
        return resolve_options(raw or {}, max_running_requests=8,
                               mamba_slots=mamba_slots).device_snapshot_slots
    assert slots(None) == 9 and slots(64) == 64 - 3 * 8
    assert slots(20) == 9                                  # never below the floor
    assert slots(64, {"device_snapshot_slots": 5}) == 5   # given wins


def test_prefix_cache_file_rejects_directory(tmp_path):
    with pytest.raises(OptionError) as err:
        resolve({"prefix_cache_file": str(tmp_path)})
    assert str(err.value) == f"--prefix-cache-file={tmp_path}: is a directory"


def test_prefix_cache_file_rejects_missing_parent(tmp_path):
    path = tmp_path / "missing" / "cache.bin"
    with pytest.raises(OptionError) as err:
        resolve({"prefix_cache_file": str(path)})
    assert str(err.value) == (
        f"--prefix-cache-file={path}: parent directory {tmp_path / 'missing'} does not exist"
    )


def test_host_writes_start_at_half_a_device_cache_or_at_once_with_a_cache_file(tmp_path):
    assert resolve().host_write_threshold == 50
    path = str(tmp_path / "cache.bin")        # the file keeps only what is on host
    assert resolve({"prefix_cache_file": path}).host_write_threshold == 0
    assert resolve({"prefix_cache_file": path, "host_write_threshold": "80"}).host_write_threshold == 80
    assert resolve({"host_write_threshold": "0"}).host_write_threshold == 0


def test_host_tier_pinned_at_startup_unless_on_demand_and_never_on_demand_with_a_cache_file(tmp_path):
    assert resolve().host_cache_pin == "startup"
    assert resolve({"host_cache_pin": "On-Demand"}).host_cache_pin == "on-demand"
    path = tmp_path / "cache.bin"
    with pytest.raises(OptionError) as err:
        resolve({"prefix_cache_file": str(path), "host_cache_pin": "on-demand"})
    assert str(err.value) == ("--host-cache-pin=on-demand: the --prefix-cache-file data is read "
                              "into the host tier at startup: use --host-cache-pin startup")


def test_prefetch_is_off_unless_asked_and_needs_a_host_tier():
    assert resolve().host_prefetch == "off"
    assert resolve({"host_prefetch": "On"}).host_prefetch == "on"
    assert resolve({"host_prefetch": "off", "host_cache_mib": "0"}).host_prefetch == "off"
    with pytest.raises(OptionError) as err:
        resolve({"host_prefetch": "on", "host_cache_mib": "0"})
    assert str(err.value) == "--host-prefetch=on: needs a host tier (--host-cache-mib is 0)"
    with pytest.raises(OptionError, match="HPC_HOST_PREFETCH"):
        resolve_options({"host_prefetch": "early"}, max_running_requests=4,
                        from_env=True)


@pytest.mark.parametrize("name, default, asked, other, bad",
                         [("host_copy", "auto", " Kernel ", "copy-engine", "dma"),
                          ("host_restore_wait", "pass", " Layer ", "layer", "later")])
def test_host_copy_and_restore_wait_have_defaults_and_a_choice_needs_a_host_tier(
        name, default, asked, other, bad):
    flag, env = "--" + name.replace("_", "-"), "HPC_" + name.upper()
    assert getattr(resolve(), name) == default
    assert getattr(resolve({name: asked}), name) == asked.strip().lower()
    assert getattr(resolve({name: other}), name) == other
    assert getattr(resolve({name: default, "host_cache_mib": "0"}), name) == default
    with pytest.raises(OptionError) as err:
        resolve({name: other, "host_cache_mib": "0"})
    assert str(err.value) == f"{flag}={other}: needs a host tier (--host-cache-mib is 0)"
    with pytest.raises(OptionError, match=rf"{env}\): must be one of"):
        resolve_options({name: bad}, max_running_requests=4, from_env=True)


def test_restore_overlap_is_on_with_a_host_tier_and_settled_reads_and_refused_without():
    assert resolve().host_restore_overlap == "on"
    assert resolve({"host_restore_overlap": "OFF"}).host_restore_overlap == "off"
    assert resolve({"host_cache_mib": "0"}).host_restore_overlap == "off"
    assert resolve({"cache_settled_reads": "off"}).host_restore_overlap == "off"
    assert resolve({"host_restore_overlap": "off", "host_cache_mib": "0"}).host_restore_overlap == "off"
    with pytest.raises(OptionError) as err:
        resolve({"host_restore_overlap": "on", "host_cache_mib": "0"})
    assert str(err.value) == "--host-restore-overlap=on: needs a host tier (--host-cache-mib is 0)"
    with pytest.raises(OptionError) as err:
        resolve({"host_restore_overlap": "on", "cache_settled_reads": "off"})
    assert str(err.value) == ("--host-restore-overlap=on: needs settled reads "
                              "(--cache-settled-reads is off)")
    with pytest.raises(OptionError, match="HPC_HOST_RESTORE_OVERLAP"):
        resolve_options({"host_restore_overlap": "sometimes"}, max_running_requests=4,
                        from_env=True)


def test_a_store_directory_turns_the_file_tier_on_and_writes_everything_to_host(tmp_path):
    opts = resolve({"cache_store_dir": str(tmp_path / "tier")})
    assert (opts.cache_store, opts.host_write_threshold) == ("file", 0)
    config = '{"master_server_address": "10.0.0.1:50051", "metadata_server": "http://10.0.0.1:8080/metadata"}'
    assert resolve({"cache_store_config": config}).cache_store == "mooncake"


@pytest.mark.parametrize("raw,message", [
    ({"cache_store": "file"}, "--cache-store=file: needs --cache-store-dir"),
    ({"cache_store": "mooncake"}, "--cache-store=mooncake: needs --cache-store-config"),
    ({"cache_store": "disk"}, "--cache-store=disk: must be one of off, file, mooncake"),
    ({"cache_store_writer": "fork"}, "--cache-store-writer=fork: must be one of process, threads"),
    ({"cache_store_config": "[1]"}, "--cache-store-config=[1]: must be a JSON object"),
    ({"cache_store_config": "{oops"}, "--cache-store-config={oops: not JSON"),
    ({"cache_store_dir": "DIR", "host_cache_mib": "0"}, "needs a host tier"),
    ({"cache_store_dir": "DIR", "prefix_cache_file": "FILE"}, "drop --prefix-cache-file"),
    ({"cache_store_wait_ms": "-1"}, "--cache-store-wait-ms=-1: must be an integer >= 0"),
    ({"cache_store_sync_ms": "-5"}, "--cache-store-sync-ms=-5: must be an integer >= 0"),
    ({"cache_store_sync_ms": "x"}, "--cache-store-sync-ms=x: not an integer"),
])
def test_a_store_option_refused_names_flag_and_why(tmp_path, raw, message):
    raw = {k: v.replace("DIR", str(tmp_path / "tier")).replace("FILE", str(tmp_path / "c.bin"))
           for k, v in raw.items()}
    with pytest.raises(OptionError, match=re.escape(message)):
        resolve(raw)


def test_a_store_directory_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(OptionError, match="is not a directory"):
        resolve({"cache_store_dir": str(tmp_path / "f")})


def test_prefix_cache_file_needs_host_tier(tmp_path):
    path = tmp_path / "cache.bin"
    with pytest.raises(OptionError) as err:
        resolve({"prefix_cache_file": str(path), "host_cache_mib": "0"})
    assert str(err.value) == f"--prefix-cache-file={path}: needs a host tier (--host-cache-mib is 0)"


def test_environment_values_and_error_source(tmp_path):
    env = {
        "HPC_HOST_CACHE_MIB": "2048",
        "HPC_DEVICE_SNAPSHOT_SLOTS": "9",
        "HPC_CACHE_TAPS_PER_REQUEST": "4",
        "HPC_CACHE_TAP_LADDER": "8192",
        "HPC_CACHE_TAP_MIN_GAP": "2048",
        "HPC_CACHE_ZERO_SPLIT": "OFF",
        "HPC_CACHE_SETTLED_READS": "ON",
        "HPC_PREFIX_CACHE_FILE": str(tmp_path / "c.bin"),
        "UNRELATED": "x",
    }
    opts = options_from_env(max_running_requests=2, environ=env)
    assert opts == HybridOptions(**{**DEFAULTS, "host_cache_mib": 2048, "device_snapshot_slots": 9,
                                    "cache_taps_per_request": 4, "cache_tap_ladder": 8192,
                                    "cache_tap_min_gap": 2048, "cache_zero_split": "off",
                                    "prefix_cache_file": str(tmp_path / "c.bin"),
                                    "host_write_threshold": 0})
    assert raw_options_from_env({"HPC_CACHE_TAP_LADDER": "64"}) == {"cache_tap_ladder": "64"}
    with pytest.raises(OptionError) as err:
        check_options_from_env({"HPC_CACHE_TAP_LADDER": "-5"})
    assert str(err.value) == (
        "--cache-tap-ladder=-5 (from HPC_CACHE_TAP_LADDER): must be a positive multiple of 64"
    )


def test_each_option_has_one_definition():
    assert [s.flag for s in OPTIONS] == [
        "--host-cache-mib",
        "--prefix-cache-file",
        "--cache-store-dir",
        "--cache-store-config",
        "--cache-store",
        "--cache-store-mib",
        "--cache-store-wait-ms",
        "--cache-store-sync-ms",
        "--cache-store-writer",
        "--device-snapshot-slots",
        "--cache-taps-per-request",
        "--cache-tap-ladder",
        "--cache-tap-min-gap",
        "--cache-zero-split",
        "--cache-settled-reads",
        "--cache-spare-pages",
        "--cache-coalesce",
        "--host-restore-overlap",
        "--host-prefetch",
        "--host-copy",
        "--host-restore-wait",
        "--host-write-threshold",
        "--host-cache-pin",
    ]
    for spec in OPTIONS:
        assert spec.env == "HPC_" + spec.name.upper()
        assert spec.flag == "--" + spec.name.replace("_", "-")
        assert spec.help


def test_parse_option_none_means_not_given():
    assert parse_option("host_cache_mib", None) is None
    assert parse_option("host_cache_mib", 0) == 0


def test_describe_is_one_line(tmp_path):
    opts = resolve({"prefix_cache_file": str(tmp_path / "c.bin")}, c=4)
    assert opts.describe() == (
        f"hybrid prefix cache options in force: --host-cache-mib 8192, --prefix-cache-file "
        f"{tmp_path / 'c.bin'}, --cache-store-dir none, --cache-store-config none, --cache-store "
        f"off, --cache-store-mib 65536, --cache-store-wait-ms 1000, --cache-store-sync-ms 0, "
        f"--cache-store-writer process, --device-snapshot-slots 5, "
        f"--cache-taps-per-request 8, "
        f"--cache-tap-ladder 4096, --cache-tap-min-gap 1024, --cache-zero-split auto, "
        f"--cache-settled-reads on, --cache-spare-pages 16, --cache-coalesce off, "
        f"--host-restore-overlap on, --host-prefetch off, --host-copy auto, --host-restore-wait "
        f"pass, --host-write-threshold 0, --host-cache-pin startup"
    )
    assert "--host-cache-mib 0, --prefix-cache-file none, " in resolve({"host_cache_mib": 0}).describe()
    assert "--cache-settled-reads off, " in resolve({"cache_settled_reads": "off"}).describe()


def test_zero_split_is_auto_or_off():
    assert resolve({}).cache_zero_split == "auto"
    assert resolve({"cache_zero_split": " Off "}).cache_zero_split == "off"
    with pytest.raises(OptionError) as err:
        resolve({"cache_zero_split": "on"})
    assert str(err.value) == "--cache-zero-split=on: must be one of auto, off"


def test_bad_limits_and_unknown_names():
    with pytest.raises(ValueError, match="max_running_requests must be >= 1, got 0"):
        resolve(c=0)
    with pytest.raises(KeyError):
        resolve({"host_cache": "1"})


def test_imports_neither_torch_nor_sglang():
    code = "import sys, hpc_radix.options; print(sorted({'torch', 'sglang'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.strip() == "[]"


def test_the_options_page_is_the_table_and_help_says_the_same():
    import argparse
    import os

    from hpc_radix.options import OPTIONS, options_markdown

    page = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "options.md")
    with open(page) as f:
        assert f.read() == options_markdown(), "docs/options.md is stale: python -m hpc_radix.options"
    pytest.importorskip("sglang")
    from hpc_radix.binding.plugin import _add_cli_args

    parser = argparse.ArgumentParser()
    _add_cli_args(None, parser)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    for spec in OPTIONS:
        assert spec.help in helps[spec.flag] and spec.env in helps[spec.flag], spec.flag


def test_every_hpc_variable_the_code_reads_is_documented():
    import os
    import re

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    names = set()
    for top in ("src", "patches", "kernels"):
        for folder, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(folder, name)) as f:
                        names.update(re.findall(r"[\"'](HPC_[A-Z_]+)[\"']", f.read()))
    docs = ""
    for page in ("options.md", "operations.md"):
        with open(os.path.join(root, "docs", page)) as f:
            docs += f.read()
    assert len(names) > 15
    assert not {n for n in names if f"`{n}" not in docs}, "undocumented HPC_* variables"


def test_every_section_reference_names_a_section_of_the_design():
    import os
    import re

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "docs", "design.md")) as f:
        sections = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", f.read(), re.M))
    assert {"5.3", "9.3", "7.1"} <= sections
    missing = {}
    for top in ("src", "patches", "kernels", "tests", "benchmarks", "docs", "README.md"):
        path = os.path.join(root, top)
        walk = [(os.path.dirname(path), [], [top])] if os.path.isfile(path) else os.walk(path)
        for folder, _, files in walk:
            if os.sep + "results" in folder or "egg-info" in folder:
                continue               # benchmark reports are records of their day
            for name in files:
                if name.endswith((".py", ".md")):
                    with open(os.path.join(folder, name)) as f:
                        for ref in re.findall(r"§(\d+(?:\.\d+)?)", f.read()):
                            if ref not in sections:
                                missing.setdefault(ref, name)
    assert not missing, f"references to sections docs/design.md lacks: {missing}"


def test_diagnostic_switches_read_from_one_table():
    from hpc_radix.options import DIAGNOSTICS, diagnostic

    assert diagnostic("profile", {}) is False and diagnostic("snapshot_kernel", {}) is True
    assert diagnostic("profile", {"HPC_CACHE_PROFILE": "1"}) is True
    assert diagnostic("snapshot_kernel", {"HPC_SNAPSHOT_KERNEL": "0"}) is False
    assert diagnostic("full_check", {"HPC_CACHE_FULL_CHECK": "0"}) is False
    assert {env for env, _ in DIAGNOSTICS.values()} == {
        "HPC_CACHE_FULL_CHECK", "HPC_CACHE_PROFILE", "HPC_SCHEDULER_PHASES", "HPC_SYNC_CENSUS",
        "HPC_SNAPSHOT_KERNEL", "HPC_TP_CHECK"}
