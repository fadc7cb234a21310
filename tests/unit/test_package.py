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
    pytest.importorskip("wheel", reason="builds with this environment's setuptools and wheel")
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


def _module_imports() -> dict[str, set[str]]:
    """Every hpc_radix module (src/, patches/, kernels/) and the hpc_radix modules it imports
    anywhere in its file (at the top, in a function, under TYPE_CHECKING)."""
    import ast
    import glob
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    files = {}
    for path in glob.glob(os.path.join(root, "src", "hpc_radix", "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, os.path.join(root, "src"))[:-3].replace(os.sep, ".")
        files[rel.removesuffix(".__init__")] = (path, rel.endswith("__init__"))
    for folder in ("patches", "kernels"):
        for path in glob.glob(os.path.join(root, folder, "*.py")):
            files[f"hpc_radix.{folder}.{os.path.basename(path)[:-3]}"] = (path, False)
    graph = {}
    for name, (path, is_package) in files.items():
        package = name if is_package else name.rpartition(".")[0]
        with open(path) as f:
            tree = ast.parse(f.read())
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                if node.module:                   # (``from . import x`` imports x alone)
                    out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {m for m in out if m in files and m != name}
    return graph


def test_no_import_circle_anywhere_in_the_package():
    """Layers import downward only: no module reaches one that reaches it back, directly or
    through others (a package's __init__ counts as the modules it imports)."""
    graph = _module_imports()
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_the_index_imports_nothing_of_the_binding_and_the_binding_only_its_facade():
    """The index is the layer below: it imports no binding, patch or kernel module; the
    binding reaches it through the package (PrefixIndex, its actions and records) and the
    tap planner's types, never through one of the index's parts."""
    graph = _module_imports()
    for name, deps in graph.items():
        if name.startswith("hpc_radix.index"):
            assert not {d for d in deps if not d.startswith("hpc_radix.index")} - {"hpc_radix.errors"}, name
        if name.startswith("hpc_radix.binding"):
            parts = {d for d in deps if d.startswith("hpc_radix.index.")}
            assert parts <= {"hpc_radix.index.keys", "hpc_radix.index.taps", "hpc_radix.index.roles"}, (name, parts)


def test_the_binding_uses_the_index_through_its_facade():
    """No binding module reaches into one of PrefixIndex's parts (``index.device``,
    ``index.writes``, ...): each part owns its state, and the facade is the one door."""
    import glob
    import os
    import re

    root = os.path.join(os.path.dirname(__file__), "..", "..", "src", "hpc_radix", "binding")
    parts = ("tree", "lineage", "lru", "device", "host", "pins", "lifecycle", "writes", "lookup",
             "taps", "valuation", "roles", "divergence", "ghosts")
    pattern = re.compile(r"(?<!hpc_radix\.)\bindex\.(%s)\b" % "|".join(parts))
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        with open(path) as f:
            found = pattern.findall(f.read())
        assert not found, (os.path.relpath(path, root), found)


def test_no_part_reaches_into_anothers_private_state():
    """Each class keeps its state: no ``something._name`` on an object other than ``self``
    (or the class itself) anywhere in the package, but the one attribute the cache adds to
    SGLang's requests (``req._hpc_record``)."""
    import ast
    import glob
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..", "src", "hpc_radix")
    found = []
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and node.attr != "_hpc_record"):
                found.append(f"{os.path.relpath(path, root)}:{node.lineno} .{node.attr}")
    assert not found, found
