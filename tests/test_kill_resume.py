"""Nothing lost: SIGKILL the migrating process, the device server or the browser at random
moments of a migration (several seeds), resume, and get exactly the state of an uninterrupted run.

Migrations run in processes forked from a warm "zygote" (a Python process that imported tapml
and torch but ran nothing), so that each kill and resume costs milliseconds of startup instead
of seconds; what is killed is still a real process doing real file I/O. The CLI's own
``--resume`` is covered by tests/test_migrate.py.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import NEEDS_CHROMIUM

from tapml.driving.journal import journal_path

ZYGOTE = r"""
import json, os, sys, traceback
import torch  # noqa: F401 - imported once here, before any fork; no op runs in this process
from tapml.carving import CarveStore
from tapml.errors import TapmlError
from tapml.driving.migrate import Migration, MigrationInterrupted, exit_code
from tapml.driving.targets import open_target

def migrate(req):
    store = CarveStore(req["store"])
    with open_target(req["target"], token=req.get("token"), inject=req["inject"]) as platform:
        browser = getattr(getattr(platform, "inner", platform), "browser", None)
        if browser is not None:
            with open(req["state"] + ".browser-pid", "w") as f:
                f.write(str(browser.pid))
        state = Migration(store, platform, req["target"], req["state"], inject=req["inject"],
                          resume=req["resume"]).run()
        relaunches = getattr(getattr(platform, "inner", platform), "relaunches", 0)
    return {"exit": exit_code(state), **({"relaunches": relaunches} if relaunches else {})}

for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            outcome = migrate(req)
        except TapmlError as e:  # MigrationInterrupted included
            outcome = {"exit": 2, "message": str(e), "interrupted": isinstance(e, MigrationInterrupted)}
        except BaseException:
            outcome = {"exit": 3, "message": traceback.format_exc()}
        with open(req["state"] + ".outcome", "w") as f:
            json.dump(outcome, f)
        sys.stdout.flush()
        os._exit(0)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(status, flush=True)
"""

KILL_TIMEOUT_S = 60


class Zygote:
    """A warm process that forks one migration per request."""

    def __init__(self):
        env = {k: v for k, v in os.environ.items() if k != "TAPML_TOKEN"}
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.child: int | None = None

    def start(self, store, target, state, inject=(), resume=False, token=None) -> int:
        Path(f"{state}.outcome").unlink(missing_ok=True)
        req = {"store": str(store), "target": target, "state": str(state), "inject": list(inject),
               "resume": resume, "token": token}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        self.child = int(self.proc.stdout.readline())
        return self.child

    def wait(self, state) -> dict:
        """Wait for the running migration; its outcome (``{"exit", "message"}``), or ``{"killed": sig}``."""
        status = int(self.proc.stdout.readline())
        self.child = None
        if os.WIFSIGNALED(status):
            return {"killed": os.WTERMSIG(status)}
        return json.loads(Path(f"{state}.outcome").read_text())

    def close(self) -> None:
        if self.child is not None:
            try:
                os.kill(self.child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def journal_lines(state) -> int:
    try:
        return journal_path(state).read_text().count("\n")
    except FileNotFoundError:
        return 0


def kill_when(victim, state, lines: int, rng: random.Random, child: int) -> bool:
    """SIGKILL ``victim()`` (a pid) once the journal of ``state`` holds ``lines`` lines, a random few
    milliseconds later (mid-verdict); False when the migration ``child`` finished first."""
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while journal_lines(state) < lines:
        if _exited(child):
            return False
        assert time.monotonic() < deadline, f"the migration did not reach journal line {lines}"
        time.sleep(0.002)
    time.sleep(rng.uniform(0, 0.03))
    try:
        os.kill(victim(), signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def normalized(state: dict) -> dict:
    """A state without what differs between runs of the same migration: timings, the target's
    address and the store's path."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("time_ms", "device_ms")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip({k: v for k, v in state.items() if k not in ("target", "store")})


def verdicts_lost(expected: dict, final: dict) -> int:
    """Verdicts (cases and units) of the uninterrupted run that the resumed run lacks or has otherwise."""
    exp, got = normalized(expected), normalized(final)
    lost = 0
    for key in ("cases", "units"):
        have = {v["id"]: v for v in got.get(key, [])}
        lost += sum(have.get(v["id"]) != v for v in exp[key])
    return lost


def check_same(expected: dict, state_path) -> int:
    final = json.loads(Path(state_path).read_text())
    assert final["complete"]
    lost = verdicts_lost(expected, final)
    assert lost == 0
    assert normalized(final) == normalized(expected)
    assert not any("device lost" in (v.get("message") or "") for v in final["cases"] + final["units"])
    return lost


def uninterrupted(zygote, store, target, tmp_path, inject, name="whole.json", token=None) -> dict:
    state = tmp_path / name
    zygote.start(store, target, state, inject, token=token)
    outcome = zygote.wait(state)
    assert outcome.get("exit") in (0, 1), outcome
    return json.loads(state.read_text())


GPT2_FAULT = ["aten.tanh.default@tanh_1=scale:1.01"]  # found by bisecting a region: every stage has work
MLP_FAULT = ["aten.addmm.default@addmm_1=scale:1.01"]


@pytest.mark.slow
def test_kill_the_migrating_process_at_random_moments(zygote, carved, tmp_path, figure):
    store = carved("zoo:tiny-gpt2")
    expected = uninterrupted(zygote, store, "reference", tmp_path, GPT2_FAULT)
    total = journal_lines(tmp_path / "whole.json")
    kills = lost = 0
    for seed in (1, 2):  # two kills each: the second one of a resumed run
        rng = random.Random(seed)
        state = tmp_path / f"seed{seed}.json"
        points = sorted(rng.sample(range(2, total - 1), 2))
        for i, at in enumerate(points):
            child = zygote.start(store, "reference", state, GPT2_FAULT, resume=i > 0)
            killed = kill_when(lambda: child, state, at, rng, child)
            outcome = zygote.wait(state)
            if killed:
                assert outcome == {"killed": signal.SIGKILL}
                kills += 1
                partial = json.loads(state.read_text())  # the state file is whole at any instant
                assert not partial["complete"]
        zygote.start(store, "reference", state, GPT2_FAULT, resume=True)
        assert zygote.wait(state) == {"exit": 1}  # the injected fault is a finding
        lost += check_same(expected, state)
    figure("kill -9 of the migrating process (faults injected)", kills)
    figure("verdicts lost after killing the migrating process", lost)
    assert kills >= 3


@pytest.mark.slow
def test_kill_the_device_server_at_random_moments(zygote, carved, tmp_path, figure):
    from tapml.remote.launcher import ServerProcess
    store = carved("zoo:mlp")
    token = "kill-resume-token"
    srv = ServerProcess(platform="reference", token=token)
    kills = lost = 0
    try:
        expected = uninterrupted(zygote, store, srv.target, tmp_path, MLP_FAULT, token=token)
        total = journal_lines(tmp_path / "whole.json")
        for seed in (1, 2, 3):
            rng = random.Random(seed)
            state = tmp_path / f"seed{seed}.json"
            at = rng.randrange(2, total - 1)
            child = zygote.start(store, srv.target, state, MLP_FAULT, token=token)
            start = time.monotonic()
            killed = kill_when(lambda: srv.proc.pid, state, at, rng, child)
            outcome = zygote.wait(state)
            if killed:
                srv.proc.wait()
                kills += 1
                # The migration stops at once with a message to act on, and records nothing about the lost device.
                assert outcome["exit"] == 2 and outcome["interrupted"], outcome
                assert "device lost" in outcome["message"] and "--resume" in outcome["message"]
                assert time.monotonic() - start < 30
                assert "device lost" not in journal_path(state).read_text()
                srv = ServerProcess(platform="reference", token=token, port=srv.port)  # the device comes back
                zygote.start(store, srv.target, state, MLP_FAULT, resume=True, token=token)
                outcome = zygote.wait(state)
            assert outcome == {"exit": 1}
            lost += check_same(expected, state)
    finally:
        srv.stop()
    figure("kill -9 of the device server (faults injected)", kills)
    figure("verdicts lost after killing the device server", lost)
    assert kills >= 2


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.xdist_group("browser")
@NEEDS_CHROMIUM
def test_kill_the_browser_at_random_moments_and_carry_on_on_a_fresh_page(zygote, carved, tmp_path, figure):
    store = carved("zoo:mlp")
    expected = uninterrupted(zygote, store, "browser", tmp_path, MLP_FAULT)
    assert expected["device"]["backend"] == "browser-webgpu"
    total = journal_lines(tmp_path / "whole.json")
    kills = lost = 0
    for seed in (1, 2):
        rng = random.Random(seed)
        state = tmp_path / f"seed{seed}.json"
        pid_file = Path(f"{state}.browser-pid")
        at = rng.randrange(2, total - 1)
        child = zygote.start(store, "browser", state, MLP_FAULT)
        killed = kill_when(lambda: int(pid_file.read_text()), state, at, rng, child)
        outcome = zygote.wait(state)
        if killed:
            kills += 1
            # The migration survives: the lost case is retried on a fresh browser and page.
            assert outcome == {"exit": 1, "relaunches": 1}, outcome
            assert "device lost" not in journal_path(state).read_text()
        else:
            assert outcome == {"exit": 1}, outcome
        lost += check_same(expected, state)
    figure("kill -9 of the browser (faults injected)", kills)
    figure("verdicts lost after killing the browser", lost)
    assert kills >= 1
