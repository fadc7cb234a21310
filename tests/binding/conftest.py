from sglang_harness import harness, hosted, server_args, speculative_args  # noqa: F401  (fixtures)
