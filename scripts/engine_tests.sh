#!/usr/bin/env bash
# Refits into live engines (part of the README's test command and .ci/run):
# vLLM 0.33 in its own venv under $HOME/.cache/reshard-vllm-venv (created
# once, then reused: vLLM pins its own torch, ~9.5 GB, about 8 minutes the
# first time), reshard installed into it, then python/tests/engines: live
# vLLM models built on the CPU by vLLM's own loader, one process per rank,
# their layouts traced through vLLM's load_weights, refit from Megatron-Core
# layouts over UCX and compared bit for bit with vLLM's own loader. Any
# failure, and a run that collects no tests (pytest exit 5), fails the script.
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
"$PY" -m pip install -q --disable-pip-version-check nanobind scikit-build-core pytest
if command -v ccache >/dev/null 2>&1; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
fi
echo "engine_tests: installing reshard into $VENV (compiles the module)"
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation .
export UCX_TLS="${UCX_TLS:-tcp,self,sm}" UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}" GLOO_SOCKET_IFNAME=lo
cd python/tests
"$PY" -m pytest -q -p no:cacheprovider engines
