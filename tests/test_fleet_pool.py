"""registry:// pools: a real `tapml registry`, real `tapml serve --platform reference` servers on
loopback announcing themselves to it, and `tapml replay` / `tapml migrate` spreading over them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

TOKEN = "pool-s3cret"


def tapml(*args, env=None, timeout=180):
    full = dict(os.environ)
    full.pop("TAPML_TOKEN", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "tapml.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full)


class Registry:
    def __init__(self, port: int = 0):
        self.proc = subprocess.Popen([sys.executable, "-m", "tapml.cli", "registry", "--port", str(port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        m = re.search(r"listening on udp://(\S+):(\d+)", line)
        assert m, line + self.proc.stderr.read()
        self.host, self.port = m.group(1), int(m.group(2))
        self.udp = f"udp://{self.host}:{self.port}"
        self.target = f"registry://{self.host}:{self.port}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def wait_for(registry: Registry, count: int, deadline_s: float = 30.0) -> list:
    from tapml.platforms.targets import parse_registry_target
    from tapml.remote.pool import discover
    deadline = time.monotonic() + deadline_s
    while True:
        found = discover(parse_registry_target(registry.target), timeout=1.0)
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("pool") / "mlp"
    r = tapml("carve", "zoo:mlp", "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def fleet():
    """A registry and three loopback reference servers announced to it."""
    from tapml.remote.launcher import ServerProcess
    reg = Registry()
    servers = []
    try:
        servers = [ServerProcess(platform="reference", token=TOKEN, args=("--register", reg.udp)) for _ in range(3)]
        assert len(wait_for(reg, 3)) == 3
        yield reg, servers
    finally:
        for s in servers:
            s.stop()
        reg.stop()


def verdicts_of(doc: dict) -> list[tuple]:
    return [(c["id"], c["op"], c["status"], c["max_abs_err"]) for c in doc["cases"]]


def test_replay_through_registry_equals_one_server(tmp_path, store, fleet):
    reg, servers = fleet
    env = {"TAPML_TOKEN": TOKEN}
    one, pooled = tmp_path / "one.json", tmp_path / "pool.json"
    r = tapml("replay", str(store), "--target", servers[0].target, "--json", str(one), "-q", env=env)
    assert r.returncode == 0, r.stderr
    r = tapml("replay", str(store), "--target", reg.target, "--json", str(pooled), "-q", env=env)
    assert r.returncode == 0, r.stderr
    a, b = json.loads(one.read_text()), json.loads(pooled.read_text())
    assert verdicts_of(a) == verdicts_of(b) and b["summary"] == a["summary"]
    used = {c["device"] for c in b["cases"]}
    assert used == {s.target for s in servers}, used  # every server served part of the cases
    assert sorted(d["target"] for d in b["devices"]) == sorted(s.target for s in servers)
    assert sum(d["served"] for d in b["devices"]) == len(b["cases"])
    # the pooled verdict file reads back like any other
    from tapml.judging.verdict import VerdictDocument
    doc = VerdictDocument.from_json(b)
    assert {c.device for c in doc.cases} == used


def test_platform_filter_and_token_map(tmp_path, store, fleet):
    reg, servers = fleet
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({f"{servers[0].host}:{servers[0].port}": TOKEN, "*": TOKEN}))
    r = tapml("replay", str(store), "--target", reg.target + "?platform=reference", "--token-map", str(tokens), "-q")
    assert r.returncode == 0, r.stderr
    r = tapml("replay", str(store), "--target", reg.target + "?platform=wgpu:vulkan", "--token-map", str(tokens))
    assert r.returncode == 2 and "no live device serving wgpu:vulkan" in r.stderr and "serves reference" in r.stderr
    # a pool compiles on each device for its own caps: lowering them is refused, not ignored
    r = tapml("replay", str(store), "--target", reg.target, "--token-map", str(tokens),
              "--device-limit", "max-buffer-size=1MiB")
    assert r.returncode == 2 and "cannot lower its devices' limits" in r.stderr, r.stderr


@pytest.mark.parametrize("content, says", [
    ("not json", "is not JSON"),
    ('["a"]', "non-empty JSON object"),
    ('{"no-port": "t"}', "is not HOST:PORT"),
    ('{"127.0.0.1:1": 5}', "not a non-empty string"),
])
def test_bad_token_map_exits_2(tmp_path, store, content, says):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(content)
    r = tapml("replay", str(store), "--target", "registry://127.0.0.1:9", "--token-map", str(tokens))
    assert r.returncode == 2 and says in r.stderr, r.stderr


def test_bad_registry_and_no_devices_exit_2(tmp_path, store, fleet):
    reg, servers = fleet
    r = tapml("replay", str(store), "--target", "registry://127.0.0.1")
    assert r.returncode == 2 and "registry://HOST:PORT" in r.stderr, r.stderr
    r = tapml("replay", str(store), "--target", "registry://127.0.0.1:18811?colour=red")
    assert r.returncode == 2 and "platform= and mode=" in r.stderr
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    r = tapml("replay", str(store), "--target", f"registry://127.0.0.1:{free}")
    assert r.returncode == 2 and "cannot reach the registry" in r.stderr and "tapml registry" in r.stderr
    empty = Registry()
    try:
        r = tapml("replay", str(store), "--target", empty.target)
        assert r.returncode == 2 and "no live device" in r.stderr and "--register" in r.stderr
    finally:
        empty.stop()
    r = tapml("replay", str(store), "--target", reg.target)  # no token: every server refuses
    assert r.returncode == 2 and "no live device" in r.stderr and "token" in r.stderr


def test_kill_one_server_mid_run_loses_and_duplicates_nothing(store):
    """In-process pool over three servers; one is killed -9 while cases are running."""
    from tapml.carving.store import CarveStore
    from tapml.remote.launcher import ServerProcess
    from tapml.driving.replay import replay
    from tapml.driving.targets import open_target
    reg = Registry()
    servers = [ServerProcess(platform="reference", token=TOKEN, args=("--register", reg.udp)) for _ in range(3)]
    try:
        assert len(wait_for(reg, 3)) == 3
        s = CarveStore(store)
        cases = s.cases * 12  # the same cases many times over: a long enough run to kill into
        for i, c in enumerate(cases):
            cases[i] = {**c, "id": f"{c['id']}#{i}"}
        seen: list[str] = []
        victim = servers[1]

        def on_case(v):
            seen.append(v["id"])
            if len(seen) == 15:
                victim.kill()
        with open_target(reg.target, token=TOKEN) as platform:
            doc = replay(s, platform, reg.target, cases=cases, on_case=on_case)
        ids = [c["id"] for c in doc["cases"]]
        assert ids == [c["id"] for c in cases]  # every case once, in order
        assert sorted(seen) == sorted(ids)  # reported once each
        assert doc["summary"]["pass"] == len(cases), [(c["status"], c["message"], c.get("device")) for c in doc["cases"] if c["status"] != "pass"][:3]
        used = {c["device"] for c in doc["cases"]}
        # the two survivors ran the rest; the victim shows in `used` only if it finished a case before
        # it was killed (on a loaded machine it may still be compiling its first one)
        assert len(used - {victim.target}) == 2 and used <= {srv.target for srv in servers}
        gone = [d for d in doc["devices"] if d["target"] == victim.target]
        assert gone and gone[0]["status"] != "ok" and "failures in a row" in gone[0]["status"]
        alive = [d for d in doc["devices"] if d["status"] == "ok"]
        assert len(alive) == 2 and sum(d["served"] for d in doc["devices"]) == len(cases)
    finally:
        for srv in servers:
            srv.stop()
        reg.stop()


def test_a_server_that_stops_answering_is_dropped_and_its_cases_run_elsewhere(store, monkeypatch):
    """SIGSTOP one server mid-run: its case in flight times out (TAPML_REMOTE_TIMEOUT), runs again
    on another device, and the frozen device leaves the pool with the reason; nothing is lost."""
    import signal

    from tapml.carving.store import CarveStore
    from tapml.remote.launcher import ServerProcess
    from tapml.driving.replay import replay
    from tapml.driving.targets import open_target
    monkeypatch.setenv("TAPML_REMOTE_TIMEOUT", "3")
    reg = Registry()
    servers = [ServerProcess(platform="reference", token=TOKEN, args=("--register", reg.udp)) for _ in range(3)]
    victim = servers[2]
    try:
        assert len(wait_for(reg, 3)) == 3
        s = CarveStore(store)
        cases = [{**c, "id": f"{c['id']}#{i}"} for i, c in enumerate(s.cases * 8)]
        seen: list[str] = []

        def on_case(v):
            seen.append(v["id"])
            if len(seen) == 10:
                os.kill(victim.proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with open_target(reg.target, token=TOKEN) as platform:
            doc = replay(s, platform, reg.target, cases=cases, on_case=on_case)
        assert time.monotonic() - start < 120
        ids = [c["id"] for c in doc["cases"]]
        assert ids == [c["id"] for c in cases] and sorted(seen) == sorted(ids)  # each case exactly once
        assert doc["summary"]["pass"] == len(cases)
        served = {d["target"]: d["served"] for d in doc["devices"]}
        assert sum(served.values()) == len(cases)
        # Frozen after the 10th verdict: it served at most those, and the live devices took over everything
        # after its case in flight (on a loaded machine one live server may still be starting and serve none,
        # so the share of each live device is not asserted).
        assert served[victim.target] <= 10, doc["devices"]
        assert sum(n for t, n in served.items() if t != victim.target) >= len(cases) - 10, doc["devices"]
    finally:
        if victim.proc.poll() is None:
            os.kill(victim.proc.pid, signal.SIGCONT)
        for srv in servers:
            srv.stop()
        reg.stop()


def test_registry_restart_does_not_stop_the_pool(store):
    """The pool keeps the servers it knows when its registry goes away mid-run."""
    from tapml.carving.store import CarveStore
    from tapml.remote.launcher import ServerProcess
    from tapml.driving.replay import replay
    from tapml.driving.targets import open_target
    reg = Registry()
    servers = [ServerProcess(platform="reference", token=TOKEN, args=("--register", reg.udp)) for _ in range(2)]
    try:
        assert len(wait_for(reg, 2)) == 2
        s = CarveStore(store)
        with open_target(reg.target, token=TOKEN) as platform:
            reg.stop()
            doc = replay(s, platform, reg.target)
            assert doc["summary"]["pass"] == len(s.cases)
            assert platform.pool.refresh() == 0  # no registry now: nothing joins, nothing leaves
            assert len(platform.pool.devices) == 2
    finally:
        for srv in servers:
            srv.stop()


def test_migrate_through_registry_spreads_the_op_stage(tmp_path, store, fleet):
    reg, servers = fleet
    state = tmp_path / "state.json"
    r = tapml("migrate", str(store), "--target", reg.target, "--state", str(state), "-q", env={"TAPML_TOKEN": TOKEN})
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(state.read_text())
    used = {c.get("device") for c in doc["cases"]}
    assert len(used) >= 2 and used <= {s.target for s in servers}, used
    assert all(u["status"] == "pass" for u in doc["units"])


def test_pool_map_gives_each_item_one_result_under_concurrency(fleet):
    """DevicePool.map straight: threads per device, results in order, work spread."""
    from tapml.remote.pool import DevicePool
    reg, servers = fleet
    calls = []
    lock = threading.Lock()

    def work(platform, item):
        platform.caps()
        with lock:
            calls.append(item)
        time.sleep(0.01)
        return item * 2
    with DevicePool(reg.target, token={"*": TOKEN}) as pool:
        out = pool.map(list(range(60)), work)
    assert [r for r, _ in out] == [i * 2 for i in range(60)] and sorted(calls) == list(range(60))
    assert len({t for _, t in out}) == 3
