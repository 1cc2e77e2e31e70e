#!/usr/bin/env bash
# Refits into live engines (part of the README's test command and .ci/run):
# vLLM 0.33, Megatron-Core 0.19 and Ray in one Python 3.12 venv under
# $HOME/.cache/reshard-engines-venv (vLLM pins its own torch, ~10 GB), made by
# scripts/venvs.sh (once, then reused), reshard installed into it, then
# python/tests/engines: live vLLM models built on the CPU by vLLM's own
# loader, one process per rank, their layouts traced through vLLM's
# load_weights, refit from live Megatron-Core GPTModels, from FSDP2 models and
# from Megatron layouts over UCX, and through vLLM's weight-transfer API in an
# RL loop on Ray (FSDP2 and Megatron-Core trainers), compared bit for bit with
# vLLM's own loader. Any failure, any skip, and a run that collects no tests
# (pytest exit 5), fail the script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venvs.sh engines
PY=$(bash scripts/venvs.sh --python engines)
if command -v ccache >/dev/null 2>&1; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
fi
echo "engine_tests: installing reshard into the engines venv ($PY; compiles the module)"
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation .
export UCX_TLS="${UCX_TLS:-tcp,self,sm}" UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}" GLOO_SOCKET_IFNAME=lo
cd python/tests
# A skip is a failure here (python/tests/skips.py); -rs names each.
RESHARD_SKIPS_FAIL=1 "$PY" -m pytest -q -rs -p no:cacheprovider engines
