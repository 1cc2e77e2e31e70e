#!/usr/bin/env bash
# The Python environments the tests run in, each created once under
# $HOME/.cache (they hold torch, ~5-10 GB each, so they live outside the
# clone) and brought up to date with pip (quick when nothing is missing):
#
#   bash scripts/venvs.sh [package] [vllm] [megatron]    (no argument: all three)
#   bash scripts/venvs.sh --python NAME                  (prints NAME's python; makes nothing)
#
#   package   $RESHARD_VENV (default ~/.cache/reshard-venv), the system
#             python3: the package's tests (scripts/python_tests.sh), the UCX
#             wheel's (scripts/ucx_wheel_tests.sh): nanobind,
#             scikit-build-core, numpy, pytest, ruff, torch, libucx-cu13
#   vllm      $RESHARD_VLLM_VENV (default ~/.cache/reshard-vllm-venv): vLLM
#             0.33 with the torch it pins, Ray, nanobind, scikit-build-core,
#             pytest (scripts/engine_tests.sh)
#   megatron  $RESHARD_MEGATRON_VENV (default ~/.cache/reshard-megatron-venv),
#             Python 3.12 (pyenv's, or python3.12): Megatron-Core 0.19.2,
#             torch 2.15, Megatron-Bridge 0.6.2 with what loading a HF
#             checkpoint needs (not its full dependencies: they pull in
#             TransformerEngine; shared/ENGINES.md), nanobind,
#             scikit-build-core (scripts/engine_tests.sh)
#
# reshard itself is not installed here: each test script installs the
# checkout it tests. scripts/test_all.sh runs this in the background while
# the C++ build compiles (the downloads then cost little time of their own).
set -euo pipefail
pipq() { local py=$1; shift; "$py" -m pip install -q --disable-pip-version-check "$@"; }
stamp() { echo "venvs: [$(date -u +%H:%M:%S)] $*"; }
# Where each venv lives: the one place the test scripts (and refits.py) learn it from.
venv_dir() {
  case "$1" in
    package) echo "${RESHARD_VENV:-$HOME/.cache/reshard-venv}" ;;
    vllm) echo "${RESHARD_VLLM_VENV:-$HOME/.cache/reshard-vllm-venv}" ;;
    megatron) echo "${RESHARD_MEGATRON_VENV:-$HOME/.cache/reshard-megatron-venv}" ;;
    *) echo "venvs: unknown venv '$1' (package, vllm, megatron)" >&2; return 2 ;;
  esac
}

package() {
  local venv; venv=$(venv_dir package)
  if [ ! -x "$venv/bin/python" ]; then
    stamp "creating $venv"
    python3 -m venv "$venv"
  fi
  pipq "$venv/bin/python" nanobind scikit-build-core numpy pytest ruff torch libucx-cu13
  stamp "package venv ready: $venv"
}

VLLM_VERSION=0.33.0
vllm() {
  local venv; venv=$(venv_dir vllm)
  if [ ! -x "$venv/bin/python" ]; then
    stamp "creating $venv (vLLM $VLLM_VERSION and its torch: ~9.5 GB)"
    python3 -m venv "$venv"
  fi
  local py="$venv/bin/python"
  if ! "$py" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
    pipq "$py" "vllm==$VLLM_VERSION"
  fi
  pipq "$py" nanobind scikit-build-core pytest "ray==2.60.0"
  stamp "vLLM venv ready: $venv"
}

megatron() {
  local venv; venv=$(venv_dir megatron)
  if [ ! -x "$venv/bin/python" ]; then
    # pyenv's own 3.12 first: its python3.12 shim refuses to run unless 3.12 is a global version.
    local py312="" c
    for c in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python "$(command -v python3.12 || true)"; do
      if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
        py312="$c"
        break
      fi
    done
    if [ -z "$py312" ]; then
      echo "venvs: Megatron-Core 0.19 needs Python 3.12 (python3.12 or pyenv's 3.12); none found" >&2
      return 1
    fi
    stamp "creating $venv (Megatron-Core 0.19.2, torch 2.15: ~5 GB) with $py312"
    "$py312" -m venv "$venv"
  fi
  local py="$venv/bin/python"
  if ! "$py" -c "import megatron.core, sys; sys.exit(megatron.core.__version__ != '0.19.2')" 2>/dev/null; then
    pipq "$py" "megatron-core==0.19.2" "torch==2.15.0" numpy
  fi
  if ! "$py" -m pip show -q megatron-bridge >/dev/null 2>&1; then
    pipq "$py" --no-deps "megatron-bridge==0.6.2"
    pipq "$py" "transformers<=5.12.1" einops omegaconf pyyaml tqdm rich regex six accelerate safetensors
  fi
  pipq "$py" nanobind scikit-build-core
  stamp "Megatron venv ready: $venv"
}

if [ "${1:-}" = --python ]; then
  [ $# -eq 2 ] || { echo "venvs: --python takes one venv name (package, vllm, megatron)" >&2; exit 2; }
  dir=$(venv_dir "$2") || exit 2
  echo "$dir/bin/python"
  exit 0
fi
wanted=("$@")
[ ${#wanted[@]} -eq 0 ] && wanted=(package vllm megatron)
for v in "${wanted[@]}"; do venv_dir "$v" > /dev/null || exit 2; done
for v in "${wanted[@]}"; do "$v"; done
