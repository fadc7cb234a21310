#!/usr/bin/env bash
# CPU install route for development and CI (x86-64, Python 3.11, no GPU).
#
#   bash scripts/install-cpu.sh            # -> ./.venv in the repository root
#   VENV=/some/dir bash scripts/install-cpu.sh
#   bash scripts/install-cpu.sh 0.5.23     # -> ./.venv-0.5.23 beside ./.venv (install that first)
#
# Another SGLang release (requirements/cpu-lock-RELEASE.txt) gets a venv of its own holding
# only what its lock names, --no-deps, layered over .venv's site-packages by a .pth file (after
# its own, so its sglang wins), with the project's editable path: no second torch stack.
#
# Steps (each timed):
#   1. python3 -m venv .venv, if missing
#   2. torch 2.14.1 + torchvision 0.29.1 and torch's pinned deps, --no-deps
#      (on the dev/CI machines pip takes torch/torchvision/triton/nvidia-* from the
#      local wheel stores configured in pip's config; elsewhere it downloads them)
#   3. sglang 0.5.17 and its CPU import closure, --no-deps, from requirements/cpu-lock.txt
#   4. the project's runtime + test tools, --no-deps (Mooncake Store's client and master
#      among them), and Debian's libibverbs, which those link, unpacked into the venv
#   5. the project itself, editable in setuptools' strict mode (a link tree under build/
#      maps src/hpc_radix, kernels/ -> hpc_radix.kernels and patches/ -> hpc_radix.patches;
#      the sglang.srt.plugins entry point is registered in the installed metadata).
#      A new module file needs this step again.
# Why --no-deps everywhere: see the header of requirements/cpu-lock.txt.
#
# Idempotent: a second run finds every pin satisfied and only re-does step 5.
# Never install anything torch-dependent into this venv without pins: pip would
# happily replace torch with another multi-GB CUDA build.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
RELEASE=${1:-}
LOCK=$ROOT/requirements/cpu-lock.txt
PY_BOOT=${PYTHON:-python3}

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
T_ALL=$(date +%s.%N)
step() { # step NAME CMD... : run CMD, print its wall time
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  echo "[install-cpu] $name ..."
  "$@"
  printf '[install-cpu] %-32s %6.1f s\n' "$name" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')"
}
# pip prints one "Location ... is ignored" warning per package for local wheel
# stores that don't carry it; keep the log readable.
pip_q() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }

section() { # section N: the N-th "# --- ... ---" block of the lock (1-based)
  awk -v n="$1" '/^# --- /{s++; next} s==n && /^[^#[:space:]]/{print}' "$LOCK"
}

layered() { # layered RELEASE: .venv-RELEASE over $VENV
  local lock=$ROOT/requirements/cpu-lock-$1.txt dir=$VENV-$1 site base
  [[ -f $lock ]] || { echo "no lock for SGLang $1 ($lock)" >&2; exit 1; }
  [[ -x $VENV/bin/python ]] || { echo "$VENV first: bash scripts/install-cpu.sh" >&2; exit 1; }
  [[ -x $dir/bin/python ]] || step "create venv ($dir)" "$PY_BOOT" -m venv "$dir"
  site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  base=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cat "$base"/__editable__.*.pth > "$site/zy_project.pth"       # the project's link tree
  echo "$base" > "$site/zz_base_venv.pth"                       # then everything else
  VENV=$dir step "sglang $1 ($(grep -c '^[^#]' "$lock") pkgs)" \
    pip_q install -q --no-deps --no-compile -r <(grep '^[^#]' "$lock")
  "$dir/bin/python" -c "import importlib.metadata as m, sglang.srt.server_args; assert m.version('sglang') == '$1'"
}
if [[ -n $RELEASE ]]; then
  layered "$RELEASE"
  exit 0
fi

[[ -f $LOCK ]] || { echo "missing $LOCK" >&2; exit 1; }
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
for i in 1 2 3; do section "$i" > "$TMP/s$i.txt"; done
for i in 1 2 3; do [[ -s $TMP/s$i.txt ]] || { echo "lock section $i is empty" >&2; exit 1; }; done

if [[ ! -x $VENV/bin/python ]]; then
  step "create venv ($VENV)" "$PY_BOOT" -m venv "$VENV"
fi
"$VENV/bin/python" -c 'import sys; assert sys.version_info[:2] >= (3, 10), sys.version' \
  || { echo "$VENV: Python >= 3.10 needed" >&2; exit 1; }

# --no-compile: byte-compiling every module of torch/sglang/transformers at install
# time costs ~55 s on 2 cores; Python compiles the few it imports on first use.
PIPI=(install -q --no-deps --no-compile)
step "torch stack ($(wc -l < "$TMP/s1.txt") pkgs)" pip_q "${PIPI[@]}" -r "$TMP/s1.txt"
step "sglang stack ($(wc -l < "$TMP/s2.txt") pkgs)" pip_q "${PIPI[@]}" -r "$TMP/s2.txt"
step "test tools ($(wc -l < "$TMP/s3.txt") pkgs)" pip_q "${PIPI[@]}" -r "$TMP/s3.txt"
# Mooncake Store's master and client link libibverbs even over TCP: Debian's library and its
# own dependencies, unpacked into the venv (no root; the tests point the loader at them)
ibverbs() {
  local dir=$VENV/opt/ibverbs lists; lists=$(mktemp -d)
  [[ -e $dir/usr/lib/x86_64-linux-gnu/libibverbs.so.1 ]] && return 0
  mkdir -p "$dir" "$lists/partial"
  local o=(-o "Dir::State::Lists=$lists" -o Debug::NoLocking=1)
  apt-get "${o[@]}" update -qq >/dev/null
  (cd "$TMP" && apt-get "${o[@]}" download -qq libibverbs1 libnl-3-200 libnl-route-3-200 2>/dev/null)
  for deb in "$TMP"/*.deb; do dpkg -x "$deb" "$dir"; done
  rm -rf "$lists"
}
step "libibverbs for Mooncake (Debian)" ibverbs
step "project (editable)" pip_q install -q --no-deps --no-build-isolation -e "$ROOT" --config-settings editable_mode=strict

printf '[install-cpu] %-32s %6.1f s   venv: %s\n' "total" \
  "$(awk -v a="$T_ALL" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$(du -sh "$VENV" 2>/dev/null | cut -f1)"
