#!/usr/bin/env bash
# The test suite, as the README says: every test on SGLang 0.5.17 (.venv), then, where
# `scripts/install-cpu.sh RELEASE` made .venv-RELEASE, the tests of what already runs on that
# release (docs/sglang-versions.md): the zero-split chunk kernel against the release's own,
# every hook target resolving under the name the release gives it, and the test files that
# pass there whole (the cache under that release's cache contract, the shared tier, ...).
# Exit code: the first non-zero of the runs (pytest's 5, no tests collected, included).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# the tests that pass on every release scripts/install-cpu.sh makes a venv for
PORTED=(tests/kernels tests/unit/test_hook_targets.py tests/binding/test_checkpoint_contract.py
        tests/binding/test_store_tier.py tests/binding/test_admission_soak.py
        tests/binding/test_host.py tests/binding/test_scheduler_phases.py
        tests/binding/test_tensor_parallel.py tests/binding/test_warm_up.py
        tests/binding/test_tap_split_sim.py tests/binding/test_zero_split.py
        tests/binding/test_decode_pages.py tests/binding/test_soak.py tests/binding/test_cache.py
        tests/binding/test_host_tier.py tests/binding/test_transfers.py tests/binding/test_cache_file.py
        tests/binding/test_plugin.py tests/binding/test_coalesce.py tests/binding/test_report.py
        tests/binding/test_sglang_env.py tests/binding/test_batch_syncs.py
        tests/binding/test_settled_reads.py)
rc=0
.venv/bin/python -m pytest -q tests "$@" || rc=$?
for venv in .venv-*/; do
  [[ -x $venv/bin/python ]] || continue
  echo "[test] SGLang $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))') ($venv): ${PORTED[*]}"
  "$venv/bin/python" -m pytest -q "${PORTED[@]}" "$@" || { r=$?; [[ $rc -ne 0 ]] || rc=$r; }
done
exit "$rc"
