"""A pytest plugin: with RESHARD_SKIPS_FAIL=1 a run that skips anything (a test, or a module whose
import was skipped) fails. The engine tests run so (scripts/engine_tests.sh): a missing vLLM, Ray or
Megatron-Core venv must not pass as a green run."""
import os

import pytest


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("RESHARD_SKIPS_FAIL") != "1" or exitstatus not in (pytest.ExitCode.OK,
                                                                        pytest.ExitCode.NO_TESTS_COLLECTED):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        reporter.write_line(f"RESHARD_SKIPS_FAIL=1: {len(skipped)} skipped, so this run fails: "
                            + "; ".join(f"{r.nodeid}: {r.longrepr[2] if isinstance(r.longrepr, tuple) else r.longrepr}"
                                        for r in skipped[:5]), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
