"""The skips plugin (python/tests/skips.py): with RESHARD_SKIPS_FAIL=1 a skipped test or module fails
the run; without it a skip stays a skip."""
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def run_pytest(tmp_path, body, fail_on_skip):
    (tmp_path / "test_planted.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=str(HERE), RESHARD_SKIPS_FAIL="1" if fail_on_skip else "0")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "skips", "-p", "no:cacheprovider",
                           str(tmp_path / "test_planted.py")], env=env, capture_output=True, text=True,
                          cwd=tmp_path)


def test_a_skipped_test_fails_the_run(tmp_path):
    body = "import pytest\n\ndef test_ok():\n    pass\n\ndef test_gone():\n    pytest.skip('no vllm here')\n"
    p = run_pytest(tmp_path, body, True)
    assert p.returncode == 1 and "no vllm here" in p.stdout, p.stdout
    assert run_pytest(tmp_path, body, False).returncode == 0


def test_a_module_skipped_at_import_fails_the_run(tmp_path):
    body = "import pytest\n\npytest.importorskip('no_such_module_here')\n\ndef test_x():\n    pass\n"
    p = run_pytest(tmp_path, body, True)
    assert p.returncode == 1 and "no_such_module_here" in p.stdout, p.stdout


def test_a_run_without_skips_passes(tmp_path):
    assert run_pytest(tmp_path, "def test_ok():\n    pass\n", True).returncode == 0
