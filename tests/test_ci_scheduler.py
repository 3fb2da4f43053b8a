"""The suite's own scheduler (tests/conftest.py): a crashed xdist worker costs its one test, not the run."""

import subprocess
import sys
import textwrap
from pathlib import Path

CRASHING_SUITE = '''
import os, time, pytest

@pytest.mark.xdist_group("g")
def test_g1(): time.sleep(0.2)

@pytest.mark.xdist_group("g")
def test_g2(): os._exit(1)

@pytest.mark.xdist_group("g")
def test_g3(): time.sleep(0.2)

@pytest.mark.parametrize("i", range(12))
def test_free(i): time.sleep(0.1)

@pytest.mark.xdist_group("h")
def test_h1(): time.sleep(0.5)

def test_last(): os._exit(1)
'''


def test_loadgroup_finishes_after_workers_crash(tmp_path):
    """Two workers die (one inside a group, one on the last test): the run ends, the two tests that
    crashed fail once each, and every other test runs (pytest-xdist 3.8 alone waits forever here)."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (suite / "test_crash.py").write_text(textwrap.dedent(CRASHING_SUITE))
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = suite\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-p", "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    tail = run.stdout.strip().splitlines()[-1]
    assert "2 failed, 15 passed" in tail, run.stdout[-2000:]
    assert "FAILED suite/test_crash.py::test_g2" in run.stdout and "FAILED suite/test_crash.py::test_last" in run.stdout
