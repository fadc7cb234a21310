from sglang_harness import harness, server_args  # noqa: F401  (fixtures)
