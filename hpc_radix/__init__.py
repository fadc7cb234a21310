"""hpc_radix: a hybrid prefix cache for SGLang."""
import os as _os

# setup.py installs the top-level kernels/ and patches/ as hpc_radix.kernels and
# hpc_radix.patches. Imported from a source checkout instead (python -m sglang.launch_server
# started in the checkout puts it first on sys.path), find them beside this package.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(__path__[0], "patches"))
        and _os.path.isfile(_os.path.join(_checkout, "patches", "scheduler_hooks.py"))):
    __path__.append(_checkout)
