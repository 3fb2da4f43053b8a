"""Generated suites and `tapml fleet` over a device pool: a real `tapml registry`, real loopback
`tapml serve --platform reference` servers announced to it, the generated suite under
`pytest -n 3 --tapml-target registry://...` (one device per worker, each named in the JUnit XML),
and the models x devices matrix of `tapml fleet`, surviving a server killed in the middle."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

TOKEN = "fleet-s3cret"


def run(*args, cwd=None, timeout=300):
    env = dict(os.environ, TAPML_TOKEN=TOKEN)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def tapml(*args, **kwargs):
    return run("-m", "tapml.cli", *args, **kwargs)


class Registry:
    """A `tapml registry` subprocess (UDP, a free port)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "tapml.cli", "registry", "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        m = re.search(r"listening on udp://(\S+):(\d+)", line)
        assert m, line + self.proc.stderr.read()
        self.udp = f"udp://{m.group(1)}:{m.group(2)}"
        self.target = f"registry://{m.group(1)}:{m.group(2)}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def start_pool(count: int):
    """A registry and ``count`` token-protected reference servers announced to it (waits until
    the registry lists them all)."""
    from tapml.platforms.targets import parse_registry_target
    from tapml.remote.launcher import ServerProcess
    from tapml.remote.pool import discover
    reg = Registry()
    servers = []
    try:
        servers = [ServerProcess(platform="reference", token=TOKEN, args=("--register", reg.udp)) for _ in range(count)]
        deadline = time.monotonic() + 30
        while len(discover(parse_registry_target(reg.target), timeout=1.0)) < count:
            assert time.monotonic() < deadline, "the servers did not announce themselves"
            time.sleep(0.2)
    except BaseException:
        stop_pool(reg, servers)
        raise
    return reg, servers


def stop_pool(reg, servers):
    for s in servers:
        s.stop()
    reg.stop()


@pytest.fixture(scope="module")
def pool3():
    reg, servers = start_pool(3)
    yield reg, servers
    stop_pool(reg, servers)


def test_fleet_carves_a_checkpoint_that_ships_code_only_when_trusted(tmp_path, pool3):
    """A checkpoint folder whose config's auto_map names the modeling file it ships: fleet refuses it
    (exit 2, nothing of its code run) until --trust-remote-code, then carves it with the shipped class
    and runs it on every device of the pool."""
    import torch
    from support import shipping_code

    from tapml.frontends.models import build_hf
    reg, servers = pool3
    build_hf("llama", {"num_hidden_layers": 1})[0].to(torch.float32).save_pretrained(tmp_path / "saved")
    folder, marker, env = shipping_code(tmp_path / "saved", tmp_path)
    env["TAPML_TOKEN"] = TOKEN
    command = [sys.executable, "-m", "tapml.cli", "fleet", str(folder), "--target", reg.target, "-q"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode == 2 and "--trust-remote-code" in refused.stderr, refused.stderr[-2000:]
    assert not marker.exists()
    out = tmp_path / "fleet.json"
    done = subprocess.run([*command, "--trust-remote-code", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert marker.read_text() == "ran"
    doc = json.loads(out.read_text())
    assert doc["kind"] == "fleet" and doc["models"] == [str(folder)]
    assert {d["target"] for d in doc["devices"]} == {s.target for s in servers}


def test_generated_suite_runs_one_device_per_xdist_worker(tmp_path, carved, pool3):
    reg, servers = pool3
    suite = tmp_path / "gen"
    r = tapml("gen-tests", str(carved("zoo:mlp")), "-o", str(suite))
    assert r.returncode == 0, r.stderr
    junit = tmp_path / "j.xml"
    # -n auto: as many workers as the pool has live devices
    r = run("-m", "pytest", "-p", "no:cacheprovider", "-n", "auto", str(suite), "--tapml-target", reg.target,
            f"--junitxml={junit}", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "created: 3/3 workers" in r.stdout
    cases = ET.parse(junit).getroot().findall(".//testcase")
    assert cases and all(c.find("failure") is None and c.find("error") is None for c in cases)
    devices = [{p.get("name"): p.get("value") for p in c.iter("property")} for c in cases]
    assert all(d["tapml_status"] == "pass" and d["tapml_adapter"] == "cpu" for d in devices)
    # Three workers, three devices: every server of the pool ran some of the tests, each its own.
    assert {d["tapml_device"] for d in devices} == {s.target for s in servers}


def test_fleet_prints_the_models_by_devices_matrix(tmp_path, carved, pool3):
    reg, servers = pool3
    from tapml.carving import CarveStore
    stores = {"mlp": carved("zoo:mlp"), "cnn": carved("zoo:cnn")}
    out = tmp_path / "fleet.json"
    r = tapml("fleet", str(stores["mlp"]), str(stores["cnn"]), "--target", reg.target, "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "model coverage: 2 models on 3 targets" in r.stdout
    assert "6/6 model x device cells pass" in r.stdout
    doc = json.loads(out.read_text())
    targets = sorted(s.target for s in servers)
    assert doc["kind"] == "fleet" and doc["models"] == [str(stores["mlp"]), str(stores["cnn"])]
    assert [d["target"] for d in doc["devices"]] == targets and all(d["status"] == "ok" for d in doc["devices"])
    for name, path in stores.items():
        per_device = doc["runs"][str(path)]
        assert sorted(per_device) == targets
        ids = [c["id"] for c in CarveStore(path).cases]
        for target, verdicts in per_device.items():
            assert verdicts["target"] == target
            assert [c["id"] for c in verdicts["cases"]] == ids
            assert verdicts["summary"]["pass"] == len(ids)
    total = sum(len(CarveStore(p).cases) for p in stores.values())
    assert all(d["served"] == total for d in doc["devices"])
    matrix = doc["matrix"]
    assert [c["target"] for c in matrix["columns"]] == targets
    assert sorted(row["op"] for row in matrix["rows"]) == sorted(doc["models"])
    assert all(cell["status"] == "pass" for row in matrix["rows"] for cell in row["cells"])

    # The HTML report renders the same matrix: a row per model, a column per device.
    html = tmp_path / "fleet.html"
    r = tapml("report", str(out), "-o", str(html))
    assert r.returncode == 0, r.stdout + r.stderr
    text = html.read_text()
    assert "Models across devices" in text and all(t in text for t in targets)

    r = tapml("fleet", str(stores["mlp"]), "--target", servers[0].target)
    assert r.returncode == 2 and "registry://" in r.stderr


def test_a_server_killed_mid_fleet_drops_out_and_the_rest_finish(carved, tmp_path):
    from tapml.carving import CarveStore
    from tapml.driving.fleet import run_fleet
    from tapml.remote.pool import DevicePool
    reg, servers = start_pool(2)
    try:
        victim = servers[0]
        models = [("mlp", CarveStore(carved("zoo:mlp"))), ("cnn", CarveStore(carved("zoo:cnn")))]
        done = {}

        def on_case(model, target, verdict):
            done[target] = done.get(target, 0) + 1
            if target == victim.target and done[target] == 3:
                victim.kill()  # SIGKILL: the server dies with connections open

        with DevicePool(reg.target, token=TOKEN) as pool:
            doc = run_fleet(models, pool, on_case=on_case)  # runs, devices, left_out
            assert victim.target in pool.removed
        devices = {d["target"]: d for d in doc["devices"]}
        survivor = servers[1].target
        assert devices[survivor]["status"] == "ok"
        assert devices[victim.target]["status"].startswith("dropped:") and devices[victim.target]["served"] == 3
        for label, store in models:
            ids = [c["id"] for c in store.cases]
            for target in (victim.target, survivor):
                # Every case has exactly one verdict on each device, in the store's order.
                assert [c["id"] for c in doc["runs"][label][target]["cases"]] == ids
            assert all(c["status"] == "pass" for c in doc["runs"][label][survivor]["cases"])
        lost = [c for label, _ in models for c in doc["runs"][label][victim.target]["cases"]]
        assert [c["status"] for c in lost[:3]] == ["pass"] * 3
        assert all(c["status"] == "error" and "dropped out" in c["message"] for c in lost[3:])

        # The CLI on a pool whose killed server is still announced: left out, reported, the run completes.
        out = tmp_path / "after.json"
        r = tapml("fleet", str(carved("zoo:mlp")), "--target", reg.target, "--json", str(out))
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"{victim.target} left out" in r.stdout.replace("\n", " ")
        after = json.loads(out.read_text())
        assert [d["target"] for d in after["devices"]] == [survivor] and victim.target in after["left_out"]
    finally:
        stop_pool(reg, servers)
