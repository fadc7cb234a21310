"""The SGLang version check (sglang_version.py): inside the tested range the release is
named, above it a warning names the range, below it the hybrid cache refuses to start."""
from __future__ import annotations

import pytest

from hpc_radix import sglang_version
from hpc_radix.errors import HybridConfigError

OLDEST, NEWEST = sglang_version.TESTED[0], sglang_version.TESTED[-1]


def test_a_tested_release_and_its_post_releases_start_silently():
    assert sglang_version.check(OLDEST) is None
    assert sglang_version.check(NEWEST + ".post1") is None
    assert sglang_version.describe(NEWEST) == f"SGLang {NEWEST} (tested: {sglang_version.tested_range()})"


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


def test_the_installed_release_is_tested_or_the_next_one_with_its_warning():
    """CI installs what TESTED names (a release outside it means one of the two moved alone),
    and beside it the newer release being ported, which starts with the warning naming the
    tested range."""
    installed = sglang_version.installed()
    if installed in sglang_version.TESTED:
        assert sglang_version.check() is None
    else:
        assert sglang_version.release(installed) > sglang_version.release(sglang_version.TESTED[-1])
        assert f"({sglang_version.tested_range()})" in sglang_version.check()
