"""The install layout: nothing in the checkout shadows an installed package, and the package
finds its kernels and patches the same installed, editable or from a wheel."""
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_in_root(code: str) -> list[str]:
    # `python -c` in the checkout puts the repository root first on sys.path, as
    # `python -m sglang.launch_server` started there does
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.split()


def test_repository_root_does_not_shadow_sglangs_kernels_package():
    pytest.importorskip("kernels")    # the HF package sglang's FA3 loader imports
    out = _run_in_root("import sglang, kernels; print(kernels.__file__)")
    assert out[0] != "None" and not out[0].startswith(ROOT + os.sep + "kernels"), out


def test_package_reaches_its_kernels_and_patches_from_the_root():
    out = _run_in_root("import hpc_radix.kernels.snapshot_copy as k, "
                       "hpc_radix.patches.scheduler_hooks as p; print(k.__name__, p.__name__)")
    assert out == ["hpc_radix.kernels.snapshot_copy", "hpc_radix.patches.scheduler_hooks"]


@pytest.mark.parametrize("name", ["hpc_radix.setup", "hpc_radix.tests", "hpc_radix.benchmarks"])
def test_checkout_folders_are_not_importable_under_the_package(name):
    code = f"import importlib.util as u; print(u.find_spec({name!r}) is None)"
    assert _run_in_root(code) == ["True"]


def test_wheel_maps_kernels_and_patches_under_the_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), ROOT], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    names = set(zipfile.ZipFile(tmp_path / wheel).namelist())
    for module in ("hpc_radix/kernels/snapshot_copy.py", "hpc_radix/patches/scheduler_hooks.py",
                   "hpc_radix/index/index.py", "hpc_radix/binding/plugin.py"):
        assert module in names
    assert not any(n.startswith(("kernels/", "patches/", "tests/", "benchmarks/")) for n in names)
    entry_points = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(tmp_path / wheel).read(entry_points[0]).decode()
    assert "sglang.srt.plugins" in text and "hpc_radix.binding.plugin:register" in text


def test_patches_never_import_the_binding():
    """Layers import downward only: the patches reach the cache through SGLang's objects and
    take shared exceptions from hpc_radix.errors."""
    import os
    import re

    folder = os.path.join(os.path.dirname(__file__), "..", "..", "patches")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                assert not re.search(r"(from|import) hpc_radix\.binding", f.read()), name


def test_patches_reach_the_cache_through_its_typed_hooks_not_by_name():
    """The patches ask the tree cache through hpc_radix.hooks.SchedulerHooks (hooks_of), never
    by looking a method or attribute up by name, and keep their switches in one object."""
    import os
    import re

    folder = os.path.join(os.path.dirname(__file__), "..", "..", "patches")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                text = f.read()
            assert not re.search(r"getattr\([^,]*(cache|tree_cache)\s*,", text), name
            assert not re.search(r"^\s*global\s", text, re.M), name


def test_no_class_has_more_than_40_methods():
    """Classes with one job each: the widest (PrefixIndex, HybridRadixCache) sit over
    components; a class growing past 40 methods should be split, not extended."""
    import ast
    import glob
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    wide = []
    for path in glob.glob(os.path.join(root, "src", "hpc_radix", "**", "*.py"), recursive=True) \
            + glob.glob(os.path.join(root, "patches", "*.py")) + glob.glob(os.path.join(root, "kernels", "*.py")):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                if methods > 40:
                    wide.append(f"{node.name} ({methods}) in {os.path.relpath(path, root)}")
    assert not wide, wide
