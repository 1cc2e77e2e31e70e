#!/usr/bin/env bash
# The Python package's tests (part of the README's test command and .ci/run):
# the venv under $HOME/.cache/reshard-venv (scripts/venvs.sh: created once,
# then reused; torch is ~5 GB, so it lives outside the clone) with nanobind,
# scikit-build-core, numpy, pytest, ruff and torch from PyPI; `ruff check python/`; `pip install .` of
# this repository; then pytest over python/tests. Any failure, and a run that collects no tests
# (pytest exit 5), fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venvs.sh package
PY=$(bash scripts/venvs.sh --python package)
# Lint first (seconds): the rules are pyproject.toml's [tool.ruff].
"$PY" -m ruff check python/
# Incremental rebuilds: scikit-build-core keeps build-python/<wheel tag>; ccache when present.
if command -v ccache >/dev/null 2>&1; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
fi
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation .
# UCX on one host (Debian's 1.13): TCP over loopback, shared memory, self.
export UCX_TLS="${UCX_TLS:-tcp,self,sm}" UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
# Plans are compared with reshard-plan's when the README build made it.
if [ -x build/bin/reshard-plan ]; then
  export RESHARD_PLAN="$PWD/build/bin/reshard-plan" RESHARD_REQUIRE_CLI=1
fi
# From python/tests, so that `import reshard` is the installed package, not python/reshard.
cd python/tests
# engines/ needs the engines' own venvs: scripts/engine_tests.sh runs it.
"$PY" -m pytest -q -rs -p no:cacheprovider --ignore=engines .
