#!/usr/bin/env bash
# The Python environments the tests run in, each created once under
# $HOME/.cache (they hold torch, ~5-10 GB each, so they live outside the
# clone) and brought up to date with pip (quick when nothing is missing):
#
#   bash scripts/venvs.sh [package] [engines]    (no argument: both)
#   bash scripts/venvs.sh --python NAME          (prints NAME's python; makes nothing)
#
#   package   $RESHARD_VENV (default ~/.cache/reshard-venv), the system
#             python3: the package's tests (scripts/python_tests.sh), the UCX
#             wheel's (scripts/ucx_wheel_tests.sh): nanobind,
#             scikit-build-core, numpy, pytest, ruff, torch, libucx-cu13
#   engines   $RESHARD_ENGINES_VENV (default ~/.cache/reshard-engines-venv),
#             Python 3.12 (pyenv's, or python3.12): vLLM 0.33 with the torch
#             it pins (2.14), Megatron-Core 0.19.2, Megatron-Bridge 0.6.2 with
#             what loading a HF checkpoint needs (not its full dependencies:
#             they pull in TransformerEngine; it runs with vLLM's transformers
#             5.20 for what the tests use, shared/ENGINES.md), Ray, nanobind,
#             scikit-build-core, pytest (scripts/engine_tests.sh). One venv:
#             Ray runs every actor of the RL loop, Megatron trainers and vLLM
#             rollouts, on one Python, and Megatron-Core needs 3.12.
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
    engines) echo "${RESHARD_ENGINES_VENV:-$HOME/.cache/reshard-engines-venv}" ;;
    *) echo "venvs: unknown venv '$1' (package, engines)" >&2; return 2 ;;
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

# pyenv's own 3.12 first: its python3.12 shim refuses to run unless 3.12 is a global version.
python312() {
  local c
  for c in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python "$(command -v python3.12 || true)"; do
    if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$c"
      return 0
    fi
  done
  echo "venvs: Megatron-Core 0.19 needs Python 3.12 (python3.12 or pyenv's 3.12); none found" >&2
  return 1
}

VLLM_VERSION=0.33.0
MEGATRON_VERSION=0.19.2
engines() {
  local venv; venv=$(venv_dir engines)
  if [ ! -x "$venv/bin/python" ]; then
    local py312; py312=$(python312)
    stamp "creating $venv (vLLM $VLLM_VERSION, Megatron-Core $MEGATRON_VERSION and torch 2.14: ~10 GB) with $py312"
    "$py312" -m venv "$venv"
  fi
  local py="$venv/bin/python"
  if ! "$py" -c "import vllm, megatron.core as m, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION' or m.__version__ != '$MEGATRON_VERSION')" 2>/dev/null; then
    pipq "$py" "vllm==$VLLM_VERSION" "megatron-core==$MEGATRON_VERSION"
  fi
  if ! "$py" -m pip show -q megatron-bridge >/dev/null 2>&1; then
    pipq "$py" --no-deps "megatron-bridge==0.6.2"
    pipq "$py" einops omegaconf pyyaml tqdm rich regex six accelerate safetensors
  fi
  pipq "$py" nanobind scikit-build-core pytest "ray==2.60.0"
  stamp "engines venv ready: $venv"
}

if [ "${1:-}" = --python ]; then
  [ $# -eq 2 ] || { echo "venvs: --python takes one venv name (package, engines)" >&2; exit 2; }
  dir=$(venv_dir "$2") || exit 2
  echo "$dir/bin/python"
  exit 0
fi
wanted=("$@")
[ ${#wanted[@]} -eq 0 ] && wanted=(package engines)
for v in "${wanted[@]}"; do venv_dir "$v" > /dev/null || exit 2; done
for v in "${wanted[@]}"; do "$v"; done
