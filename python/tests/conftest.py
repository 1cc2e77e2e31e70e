"""Shared paths and helpers of the Python tests.

Model configs: $RESHARD_MODELS, else the repository's examples/models (tiny-llama,
tiny-moe ... are copies of shared/models), else ../shared/models beside the
clone, else /work/shared/models.
"""
import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))  # oracle.py, skips.py

pytest_plugins = ["skips"]  # RESHARD_SKIPS_FAIL=1: a skip fails the run


def models_dir() -> pathlib.Path:
    for d in (os.environ.get("RESHARD_MODELS"), REPO / "examples" / "models", REPO.parent / "shared" / "models",
              pathlib.Path("/work/shared/models")):
        if d and (pathlib.Path(d) / "tiny-llama.json").exists():
            return pathlib.Path(d)
    raise RuntimeError("no model configs found (set RESHARD_MODELS to a folder with tiny-llama.json)")


@pytest.fixture(scope="session")
def models() -> pathlib.Path:
    return models_dir()


@pytest.fixture(scope="session")
def examples() -> pathlib.Path:
    return REPO / "examples"
