from setuptools import setup

setup(
    name="hpc-radix",
    version="0.1.0",
    description="Hybrid prefix cache for SGLang: KV blocks and recurrent-state snapshots in one radix tree",
    python_requires=">=3.10",
    packages=[
        "hpc_radix",
        "hpc_radix.index",
        "hpc_radix.binding",
        "hpc_radix.binding.device",
        "hpc_radix.binding.host",
        "hpc_radix.binding.store",
        "hpc_radix.kernels",
        "hpc_radix.patches",
    ],
    # The top-level kernels/ and patches/ install under hpc_radix. They carry no __init__.py:
    # a namespace directory never shadows an installed regular package, and `kernels` is a
    # PyPI package SGLang imports, so a checkout on sys.path cannot hide it.
    package_dir={"": "src", "hpc_radix.kernels": "kernels", "hpc_radix.patches": "patches"},
    install_requires=["numpy", "xxhash"],
    extras_require={
        # the releases tested (sglang_version.TESTED, post releases too); no torch pin of ours
        "sglang": ["sglang>=0.5.17,<0.5.24"],
        "test": ["pytest", "hypothesis"],
    },
    entry_points={
        "sglang.srt.plugins": ["hpc_radix = hpc_radix.binding.plugin:register"],
    },
)
