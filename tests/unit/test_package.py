"""The package imports the same from a source checkout as installed."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_checkout_finds_patches_and_kernels_beside_the_package():
    # `pip install .` then `python -m sglang.launch_server` in the checkout: the checkout's
    # hpc_radix/ comes first on sys.path and must still reach patches/ and kernels/ (-S keeps
    # any installed copy or editable finder out of the way)
    code = ("import hpc_radix.patches.scheduler_hooks as p, hpc_radix.kernels as k; "
            "print(p.__file__); print(k.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == [os.path.join(ROOT, "patches", "scheduler_hooks.py"),
                   os.path.join(ROOT, "kernels", "__init__.py")]
