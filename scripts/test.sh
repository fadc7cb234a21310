#!/usr/bin/env bash
# The test suite, as the README says: every test on SGLang 0.5.17 (.venv), then every test
# again on each release `scripts/install-cpu.sh RELEASE` made a .venv-RELEASE for (0.5.23:
# docs/sglang-versions.md says what runs there and what is refused or left to SGLang).
# Exit code: the first non-zero of the runs (pytest's 5, no tests collected, included).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

rc=0
.venv/bin/python -m pytest -q tests "$@" || rc=$?
for venv in .venv-*/; do
  [[ -x $venv/bin/python ]] || continue
  echo "[test] SGLang $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))') ($venv)"
  "$venv/bin/python" -m pytest -q tests "$@" || { r=$?; [[ $rc -ne 0 ]] || rc=$r; }
done
exit "$rc"
