#!/usr/bin/env bash
# Refits into live engines (part of the README's test command and .ci/run):
# vLLM 0.33 in its own venv under $HOME/.cache/reshard-vllm-venv (created
# once, then reused: vLLM pins its own torch, ~9.5 GB, about 5 minutes the
# first time) and Megatron-Core 0.19 in another (Python 3.12), reshard
# installed into both, then python/tests/engines: live vLLM models built on
# the CPU by vLLM's own loader, one process per rank, their layouts traced
# through vLLM's load_weights, refit from live Megatron-Core GPTModels, from
# FSDP2 models and from Megatron layouts over UCX, and compared bit for bit
# with vLLM's own loader. Any failure, and a run that collects no tests
# (pytest exit 5), fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RESHARD_VLLM_VENV:-$HOME/.cache/reshard-vllm-venv}"
VLLM_VERSION=0.33.0
if [ ! -x "$VENV/bin/python" ]; then
  echo "engine_tests: creating the venv $VENV (vLLM $VLLM_VERSION and its torch: ~9.5 GB, several minutes)"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
  "$PY" -m pip install -q --disable-pip-version-check "vllm==$VLLM_VERSION"
fi
"$PY" -m pip install -q --disable-pip-version-check nanobind scikit-build-core pytest "ray==2.60.0"
if command -v ccache >/dev/null 2>&1; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
fi
echo "engine_tests: installing reshard into $VENV (compiles the module)"
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation .
# Megatron-Core 0.19 (the live trainers) needs Python 3.12: pyenv's on this
# kind of machine. Its own venv, torch 2.15 (~5 GB, a few minutes the first time).
MVENV="${RESHARD_MEGATRON_VENV:-$HOME/.cache/reshard-megatron-venv}"
if [ ! -x "$MVENV/bin/python" ]; then
  # pyenv's own 3.12 first: its python3.12 shim refuses to run unless 3.12 is a global version.
  PY312=""
  for c in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python "$(command -v python3.12 || true)"; do
    if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      PY312="$c"
      break
    fi
  done
  if [ -z "$PY312" ]; then
    echo "engine_tests: Megatron-Core 0.19 needs Python 3.12 (python3.12 or pyenv's 3.12); none found" >&2
    exit 1
  fi
  echo "engine_tests: creating the venv $MVENV (Megatron-Core 0.19.2, torch 2.15: ~5 GB) with $PY312"
  "$PY312" -m venv "$MVENV"
fi
MPY="$MVENV/bin/python"
if ! "$MPY" -c "import megatron.core, sys; sys.exit(megatron.core.__version__ != '0.19.2')" 2>/dev/null; then
  "$MPY" -m pip install -q --disable-pip-version-check "megatron-core==0.19.2" "torch==2.15.0" numpy
fi
# Megatron-Bridge 0.6 (the oracle that loads a HF checkpoint into a live GPTModel) without its full
# dependencies (they pull in TransformerEngine): what loading needs, as shared/ENGINES.md measured.
if ! "$MPY" -m pip show -q megatron-bridge >/dev/null 2>&1; then
  "$MPY" -m pip install -q --disable-pip-version-check --no-deps "megatron-bridge==0.6.2"
  "$MPY" -m pip install -q --disable-pip-version-check "transformers<=5.12.1" einops omegaconf pyyaml tqdm rich \
    regex six accelerate safetensors
fi
"$MPY" -m pip install -q --disable-pip-version-check nanobind scikit-build-core
echo "engine_tests: installing reshard into $MVENV (compiles the module for Python 3.12)"
"$MPY" -m pip install -q --disable-pip-version-check --no-build-isolation .
export RESHARD_MEGATRON_PYTHON="$MPY" RESHARD_REQUIRE_MEGATRON=1
export UCX_TLS="${UCX_TLS:-tcp,self,sm}" UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}" GLOO_SOCKET_IFNAME=lo
cd python/tests
"$PY" -m pytest -q -p no:cacheprovider engines
