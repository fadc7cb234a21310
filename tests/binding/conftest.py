from sglang_harness import harness, hosted, server_args  # noqa: F401  (fixtures)
