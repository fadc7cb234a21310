"""The SGLang version check (sglang_version.py): inside the tested range the release is
named (with a warning where only the CPU suite ran on it), above it a warning names the range,
below it the hybrid cache refuses to start."""
from __future__ import annotations

import pytest

from hpc_radix import sglang_version
from hpc_radix.errors import HybridConfigError

OLDEST, NEWEST = sglang_version.TESTED[0], sglang_version.TESTED[-1]


def test_a_release_the_gpu_suite_ran_on_and_its_post_releases_start_silently():
    gpu = sglang_version.GPU_TESTED[-1]
    assert sglang_version.check(gpu) is None and sglang_version.check(gpu + ".post1") is None
    assert sglang_version.describe(NEWEST) == (
        f"SGLang {NEWEST} (tested: {sglang_version.tested_range()}; on GPUs: "
        f"{', '.join(sglang_version.GPU_TESTED)})")


def test_a_release_only_the_cpu_suite_ran_on_starts_with_a_warning_saying_so():
    """0.5.23: CI runs the whole CPU suite on it; the GPU machine's torch runs no GPU test
    there, and the warning says where they ran."""
    cpu_only = [v for v in sglang_version.TESTED if v not in sglang_version.GPU_TESTED]
    assert cpu_only == ["0.5.23"]
    warning = sglang_version.check("0.5.23.post1")
    assert warning.startswith("SGLang 0.5.23.post1: hpc_radix's CPU suite runs on it in CI")
    assert "GPU suite and benchmarks ran on 0.5.17 only" in warning


def test_a_newer_release_starts_with_a_warning_naming_the_tested_range():
    warning = sglang_version.check("0.9.0")
    assert "SGLang 0.9.0 is newer" in warning and sglang_version.tested_range() in warning


@pytest.mark.parametrize("old", ["0.5.16", "0.4.10.post2", "0.5.9"])
def test_an_older_release_is_refused_naming_it(old):
    with pytest.raises(HybridConfigError, match=f"SGLang {old} is older"):
        sglang_version.check(old)


def test_a_version_string_that_is_no_release_is_refused():
    with pytest.raises(HybridConfigError, match="not a release number"):
        sglang_version.check("main")


def test_ci_installs_a_tested_release():
    """CI runs the suite on each release TESTED names (a release outside it means one of the
    two moved alone)."""
    assert sglang_version.installed() in sglang_version.TESTED


def test_the_sglang_extra_installs_a_tested_release():
    """setup.py's ``sglang`` extra spans the tested releases (their post releases too) and
    pins no torch: beside a supported SGLang it changes neither."""
    import pathlib
    import re

    setup = (pathlib.Path(__file__).resolve().parents[2] / "setup.py").read_text()
    major, minor, patch = sglang_version.release(NEWEST)
    assert f'"sglang": ["sglang>={OLDEST},<{major}.{minor}.{patch + 1}"]' in setup
    assert not re.search(r'["\']torch', setup)
