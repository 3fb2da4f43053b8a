"""Who the client talks to, and what a peer may cost the server (issue 26, items 2, 3, 5, 9, 11, 12).

Real processes on loopback: impostor servers and token-less relays are separate Python processes
speaking TCP (this file's IMPOSTOR and RELAY scripts); servers are real `tapml serve` processes.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tapml.errors import TapmlError

TOKEN = "trust remote token"

# An impostor device server: it speaks the handshake without holding TOKEN and records whether a
# client went on to send anything after it (a client that accepted it would send its hello call).
IMPOSTOR = r"""
import os, socket, struct, sys, time
from tapml.remote import protocol as P
mode, real_port = sys.argv[1], int(sys.argv[2])
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
captured = None
while True:
    conn, _ = srv.accept()
    flag = 0 if mode == "no-token" else 1
    if mode == "replayed" and captured is None:
        # learn a genuine server proof: relay one handshake to the real server, keep its answer
        real = socket.create_connection(("127.0.0.1", real_port))
        hello = P.recv_exact(real, P.HELLO)
        conn.sendall(hello)
        real.sendall(P.recv_exact(conn, 1 + P.NONCE + P.MAC))
        captured = hello, P.recv_exact(real, 2 + P.MAC)
        conn.sendall(captured[1])
        conn.close(); real.close()
        continue
    if mode == "replayed":
        conn.sendall(captured[0])  # the same hello, so the same server nonce and id
        P.recv_exact(conn, 1 + P.NONCE + P.MAC)
        conn.sendall(captured[1])  # the proof of the other session
    else:
        conn.sendall(P.MAGIC + bytes([flag]) + os.urandom(P.NONCE + P.SERVER_ID))
        P.recv_exact(conn, 1 + P.NONCE + P.MAC)
        proof = {"no-token": bytes(P.MAC), "wrong": os.urandom(P.MAC), "truncated": bytes(10)}[mode]
        conn.sendall(b"OK" + proof)
        if mode == "truncated":
            conn.shutdown(socket.SHUT_WR)
    conn.settimeout(2)
    try:
        after = conn.recv(1)
    except OSError:
        after = b""
    print("SENT-AFTER-HANDSHAKE" if after else "nothing", flush=True)
    conn.close()
"""

# A relay without the token: it forwards connections to the real server and, by mode, flips a
# byte of the first tensor the server sends on a bulk connection (tamper), sends its own frame to
# the server right after the handshake (inject), or sends bulk connections to a second server
# (splice). Each connection's role is the first byte the client sends.
RELAY = r"""
import socket, struct, sys, threading
from tapml.remote import protocol as P
mode, port_a, port_b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)

def pipe(src, dst, tamper_at=None):
    seen = 0
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            if tamper_at is not None and seen <= tamper_at < seen + len(data):
                i = tamper_at - seen
                data = data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]
            seen += len(data)
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

count = 0

def handle(conn):
    global count
    count += 1
    # splice: the first connection (control) to server A, the later ones (bulk) to server B
    up = socket.create_connection(("127.0.0.1", port_b if mode == "splice" and count > 1 else port_a))
    hello = P.recv_exact(up, P.HELLO)
    conn.sendall(hello)
    answer = P.recv_exact(conn, 1 + P.NONCE + P.MAC)
    role = answer[:1]
    up.sendall(answer)
    conn.sendall(P.recv_exact(up, 2))
    if mode == "inject" and role == b"C":
        up.sendall(struct.pack("!LB", 5, 0) + b"hello" + bytes(P.MAC) + b"\n")
    # bulk, server -> client after the proof: ACK (22-byte header + 32-byte tag), then the first
    # tensor's header, shape and payload: flip a byte 30 bytes into it
    tamper = P.MAC + 54 + 30 if mode == "tamper" and role == b"B" else None
    threading.Thread(target=pipe, args=(conn, up), daemon=True).start()
    pipe(up, conn, tamper)

while True:
    c, _ = srv.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
"""


def start(script: str, *args) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)


@pytest.fixture(scope="module")
def server():
    from tapml.remote.launcher import ServerProcess
    srv = ServerProcess(platform="reference", token=TOKEN)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def mlp(carved):
    from tapml.carving.store import CarveStore
    return CarveStore(carved("zoo:mlp"))


def remote(port, token=TOKEN, host="127.0.0.1", **kwargs):
    from tapml.remote.client import RemotePlatform
    return RemotePlatform(host, port, token=token, connect_timeout=10, timeout=30, **kwargs)


# --- item 2: a client that holds a token trusts only a server that proves it ---------------

@pytest.mark.parametrize("mode", ["no-token", "wrong", "truncated", "replayed"])
def test_client_refuses_an_impostor_that_cannot_prove_the_token(server, mode):
    proc, port = start(IMPOSTOR, mode, server.port)
    try:
        if mode == "replayed":  # first connection: the impostor learns a real proof of another session
            with pytest.raises(TapmlError):
                remote(port)
        with pytest.raises(TapmlError) as refused:
            remote(port)
        message = str(refused.value)
        if mode == "truncated":
            assert "handshake failed" in message
        else:
            assert "could not prove it holds your token" in message
        if mode == "no-token":
            assert "it says it needs no token" in message
        # the client sent nothing past the handshake: no call, no tensor reached the impostor
        assert proc.stdout.readline().strip() == "nothing"
    finally:
        stop(proc)


def test_a_client_without_a_token_still_reaches_a_token_less_server():
    from tapml.remote.launcher import ServerProcess
    srv = ServerProcess(platform="reference", token=None)
    try:
        with remote(srv.port, token=None) as p:
            assert p.info["platform"] == "reference"
        # ...but a client holding a token refuses it: it cannot prove the client's token
        with pytest.raises(TapmlError, match="says it needs no token"):
            remote(srv.port)
    finally:
        assert srv.stop() == 0


# --- item 3: a relay without the token gets no session of its own ---------------------------

def test_relay_that_alters_a_tensor_is_caught_and_no_verdict_is_made_from_it(server, mlp):
    from tapml.driving.replay import replay
    proc, port = start(RELAY, "tamper", server.port, server.port)
    try:
        with remote(port) as platform:
            result = replay(mlp, platform, f"remote://127.0.0.1:{port}")
        statuses = {c["status"] for c in result["cases"]}
        assert statuses == {"error"}, statuses  # never a mismatch (or pass) made from altered bytes
        assert all("authentication check" in c["message"] for c in result["cases"])
    finally:
        stop(proc)
    # the server is unharmed; through a faithful path the same store passes
    with remote(server.port) as platform:
        assert replay(mlp, platform, server.target)["summary"]["pass"] == len(mlp.cases)


def test_relay_that_injects_a_frame_is_refused_by_the_server(server):
    proc, port = start(RELAY, "inject", server.port, server.port)
    try:
        with pytest.raises(TapmlError):
            remote(port)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("authentication check" in line for line in server.stderr_lines):
            time.sleep(0.05)
        assert any("authentication check" in line for line in server.stderr_lines)
    finally:
        stop(proc)


def test_relay_cannot_splice_connections_to_another_server_with_the_same_token(server):
    from tapml.remote.launcher import ServerProcess
    other = ServerProcess(platform="reference", token=TOKEN)
    proc, port = start(RELAY, "splice", server.port, other.port)
    try:
        with pytest.raises(TapmlError, match="reached another server"):
            remote(port)
    finally:
        stop(proc)
        assert other.stop() == 0


def test_a_faithful_relay_is_only_a_path(server, mlp):
    """Forwarding bytes unchanged is what every router does: the session works end to end."""
    from tapml.driving.replay import replay
    proc, port = start(RELAY, "forward", server.port, server.port)
    try:
        with remote(port) as platform:
            assert replay(mlp, platform, f"remote://127.0.0.1:{port}")["summary"]["pass"] == len(mlp.cases)
    finally:
        stop(proc)


def test_tampered_frames_fail_their_check():
    from tapml.remote import protocol as P
    a, b = socket.socketpair()
    result = {}

    def serve():
        result["auth"] = P.server_handshake(b, TOKEN)

    t = threading.Thread(target=serve)
    t.start()
    client = P.client_handshake(a, TOKEN, "bulk")
    t.join(10)
    server = P.Link(b, result["auth"])
    link = P.Link(a, client)
    link.send(P.PUT, 3, b"\x00" * 8, 0, (2,))
    assert server.recv(1 << 20)[4] == b"\x00" * 8
    # a frame replayed byte for byte: the counter has moved on
    head = P.HEADER.pack(P.PUT, 3, 0, 1, 8) + (2).to_bytes(8, "big")
    replayed_tag = P.FrameMac(b"x" * 32).tag(head, b"\x00" * 8)
    a.sendall(head + b"\x00" * 8 + replayed_tag)
    with pytest.raises(P.ProtocolError, match="authentication check"):
        server.recv(1 << 20)
    a.close()
    b.close()


# --- item 5: what one session may hold on the server -----------------------------------------

def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants, in MiB."""
    from support import rss_mib
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += rss_mib(p)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            pass
    return total


@pytest.fixture(scope="module")
def small_server():
    from tapml.remote.launcher import ServerProcess
    srv = ServerProcess(platform="reference", token=TOKEN, args=("--max-buffer-mib", "16"))
    yield srv
    assert srv.stop() == 0


def test_a_session_cannot_pile_up_tensors_on_the_server(small_server, mlp):
    import torch

    from tapml.errors import PlatformError
    from tapml.driving.replay import replay
    before = tree_rss_mib(small_server.proc.pid)
    four = torch.ones(1 << 20)  # 4 MiB
    with remote(small_server.port) as p:
        slots = [p.upload(four) for _ in range(4)]  # 16 MiB held, never run
        with pytest.raises(PlatformError, match="not run or downloaded.*--max-buffer-mib"):
            p.upload(four)
    with remote(small_server.port) as p:  # a fresh session starts empty; benchmark tensors count too
        held = [p.bench_tensor(8 << 20) for _ in range(2)]
        with pytest.raises(PlatformError, match="benchmark tensor"):
            p.bench_tensor(8 << 20)
        p.free(held)  # freed tensors make room again
        p.free([p.bench_tensor(8 << 20)])
    assert slots and tree_rss_mib(small_server.proc.pid) - before < 150
    with remote(small_server.port) as p:  # the server still serves
        assert replay(mlp, p, small_server.target)["summary"]["pass"] == len(mlp.cases)


def test_huge_json_requests_are_refused_before_they_are_parsed(small_server):
    from tapml.errors import PlatformError
    before = tree_rss_mib(small_server.proc.pid)
    nested = "[" + "[]," * 4_000_000 + "[]]"  # 12 MB of JSON, 4 million values
    with remote(small_server.port) as p:
        reply = json.loads(p._call("compile", nested))
        assert reply["error"]["kind"] == "unsupported" and "--max-request-elements" in reply["error"]["message"]
        reply = json.loads(p._call("load", nested))
        assert "error" in reply and "--max-request-elements" in reply["error"]["message"]
        peak = tree_rss_mib(small_server.proc.pid)
        with pytest.raises(PlatformError):  # over --max-request-mib (64): the frame is refused unread
            p._call("compile", "[" + " " * (65 << 20) + "]")
    assert peak - before < 200, f"a 12 MB request grew the server by {peak - before:.0f} MiB"
    assert any("exceeds the limit" in line for line in small_server.stderr_lines)


def test_raw_endpoint_holds_one_chunk_whatever_it_is_asked(small_server):
    from tapml.remote import protocol as P
    before = tree_rss_mib(small_server.proc.pid)
    with remote(small_server.port) as p:
        raw = p.raw_socket()
        raw.send(P.SOURCE, 512 << 20)
        assert raw.recv_header(1 << 30)[4] == 512 << 20
        raw.recv_through(512 << 20, memoryview(bytearray(1 << 20)))  # checked, not kept
        raw.send(P.PING)
        assert raw.recv(64)[0] == P.ACK
        raw.close()
    assert tree_rss_mib(small_server.proc.pid) - before < 100


def test_device_worker_runs_under_an_address_space_limit():
    from tapml.remote.device_worker import WorkerPlatform
    with WorkerPlatform("reference", address_space=6 << 30) as p:
        with open(f"/proc/{p._proc.pid}/limits") as f:
            line = next(line for line in f if line.startswith("Max address space"))
        assert line.split()[3] == str(6 << 30)


def test_an_allocation_past_the_workers_address_space_is_an_error_not_the_machines_memory():
    """An 8 GiB tensor (declared honestly) in a worker limited to 3 GiB of address space: the
    allocation fails inside the worker and the run is an `error` verdict; the worker serves on."""
    import torch

    from tapml.graph import Graph, Node, TensorMeta
    from tapml.remote.device_worker import WorkerPlatform
    from tapml.judging.verdict import outcome_verdict
    huge = TensorMeta((1 << 31,), "float32")
    graph = Graph(inputs=[], outputs=["e"], nodes=[Node(name="e", op="aten.empty.memory_format", args=[[1 << 31]],
                                                        kwargs={"dtype": {"dtype": "float32"}}, outputs=[huge])])
    with WorkerPlatform("reference", address_space=3 << 30) as p:
        try:
            p.run(p.compile(graph), [])
        except Exception as e:  # noqa: BLE001 - judged below
            verdict = outcome_verdict(e)
        else:
            pytest.fail("an 8 GiB tensor was made under a 3 GiB address-space limit")
        assert verdict.status == "error", verdict
        assert "alloc" in verdict.message.lower() or "memory" in verdict.message.lower(), verdict.message
        small = Graph(inputs=[("x", TensorMeta((2,), "float32"))], outputs=["r"],
                      nodes=[Node(name="r", op="aten.relu.default", args=[{"ref": "x"}], kwargs={},
                                  outputs=[TensorMeta((2,), "float32")])])
        assert p.run(p.compile(small), [torch.tensor([-1.0, 2.0])])[0].tolist() == [0.0, 2.0]


# --- item 11: wrong-token pacing per server, not only per address ---------------------------

def test_wrong_tokens_from_many_loopback_addresses_are_paced_together(server):
    from tapml.remote import protocol as P
    done = []

    def guess(i):
        sock = socket.socket()
        sock.bind((f"127.0.{i // 250}.{2 + i % 250}", 0))  # one address per guess
        sock.settimeout(60)
        sock.connect(("127.0.0.1", server.port))
        try:
            P.client_handshake(sock, f"guess-{i}", "control", timeout=60)
        except P.AuthError:
            done.append(time.monotonic())
        sock.close()

    start = time.monotonic()
    threads = [threading.Thread(target=guess, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    # the right token is never delayed, whatever the flood
    ok = time.monotonic()
    with remote(server.port) as p:
        assert p.info["platform"] == "reference"
    assert time.monotonic() - ok < 3
    for t in threads:
        t.join(60)
    assert len(done) == 24
    # per address, each first guess would be answered after 0.05 s; per server they queue up
    assert max(done) - start > 2.0, f"24 guesses from 24 addresses answered within {max(done) - start:.2f} s"


# --- item 12: a lost worker or connection is an error, never a verdict about the op ----------

def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _verdict_with_worker_killed(platform, store, case, worker_pid: int) -> dict:
    """The verdict of ``case`` when the device worker is stopped as the request reaches it and
    then killed with SIGKILL (so the call is in flight when it dies)."""
    from tapml.driving.replay import replay_case
    os.kill(worker_pid, signal.SIGSTOP)
    result = {}
    t = threading.Thread(target=lambda: result.update(v=replay_case(platform, store, case).to_json()))
    t.start()
    time.sleep(1.0)
    os.kill(worker_pid, signal.SIGKILL)
    t.join(60)
    return result["v"]


def _kill_worker_during_compile_and_run(platform, store, worker_pid, run_call="run"):
    case = store.cases[0]
    during_compile = _verdict_with_worker_killed(platform, store, case, worker_pid())
    assert during_compile["status"] == "error", during_compile
    assert "device worker died" in during_compile["message"]
    platform.compile(store.case_graph(case))  # on the restarted worker: now only the run is left
    during_run = _verdict_with_worker_killed(platform, store, case, worker_pid())
    assert during_run["status"] == "error", during_run
    assert f"device worker died during the {run_call}" in during_run["message"]
    from tapml.driving.replay import replay_case
    assert replay_case(platform, store, case).status == "pass"  # and the next request is served


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_killed_device_worker_of_a_vulkan_server_gives_error_verdicts(mlp):
    from support import vulkan_or_skip
    vulkan_or_skip()
    from tapml.remote.launcher import ServerProcess
    srv = ServerProcess(platform="wgpu:vulkan", token=TOKEN)
    try:
        with remote(srv.port) as platform:
            platform.caps()
            _kill_worker_during_compile_and_run(platform, mlp, lambda: _children(srv.proc.pid)[0])
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_killed_device_worker_of_a_local_worker_platform_gives_error_verdicts(mlp):
    from tapml.remote.device_worker import WorkerPlatform
    with WorkerPlatform("reference") as platform:
        def pid():
            platform._ensure_worker()
            return platform._proc.pid
        # a local worker platform compiles again for every case (no cache by graph): its second
        # kill lands in that compile; the remote test above hits the run
        _kill_worker_during_compile_and_run(platform, mlp, pid, run_call="compile")


def test_lost_connection_gives_error_verdicts_and_the_replay_goes_on(server, mlp):
    from tapml.driving.replay import replay
    proc, port = start(RELAY, "forward", server.port, server.port)
    seen = []

    def on_case(v):
        seen.append(v)
        if len(seen) == 1:
            stop(proc)  # the path to the server dies between cases

    try:
        with remote(port) as platform:
            result = replay(mlp, platform, f"remote://127.0.0.1:{port}", on_case=on_case)
    finally:
        if proc.poll() is None:
            stop(proc)
    assert result["cases"][0]["status"] == "pass"
    later = result["cases"][1:]
    assert later and all(v["status"] == "error" and "device lost" in v["message"] for v in later)


# --- item 9 (announcements): a registry announcement is type-checked, never trusted ----------

BAD_ANNOUNCEMENTS = [{"platform": "wgpu", "features": 5}, {"platform": 7}, {"platform": "x", "adapter": ["a"]},
                     {"platform": "x", "features": [1, 2]}, {"platform": "x", "features": ["f"] * 1000},
                     {"platform": "x" * 500}, ["not", "an", "object"]]


def test_announcement_fields_are_type_checked():
    from tapml.remote.announcement import check_announcement
    assert check_announcement({"platform": "wgpu", "adapter": "a", "features": ["shader-f16"], "extra": {}}) == \
        {"platform": "wgpu", "adapter": "a", "features": ["shader-f16"]}
    for bad in BAD_ANNOUNCEMENTS:
        assert check_announcement(bad) is None, bad


@pytest.mark.slow
def test_devices_survives_malformed_announcements():
    import base64

    from tapml.remote.server import SERVICE_NAME, registry_client
    reg = subprocess.Popen([sys.executable, "-m", "tapml.cli", "registry", "--port", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    listeners = []
    try:
        import re
        registry = re.search(r"listening on (udp://\S+)", reg.stdout.readline()).group(1)
        client = registry_client(registry)
        announced = [a for a in BAD_ANNOUNCEMENTS if len(json.dumps(a)) < 600]  # one datagram each
        for info in announced:
            listeners.append(socket.create_server(("127.0.0.1", 0)))  # closed below: nothing listens there
            alias = f"{SERVICE_NAME}-" + base64.b32encode(json.dumps(info).encode()).decode()
            assert client.register((SERVICE_NAME, alias), listeners[-1].getsockname()[1], interface="127.0.0.1")
        for s in listeners:
            s.close()
        rows = []
        deadline = time.monotonic() + 20
        while len(rows) < len(announced) and time.monotonic() < deadline:
            r = subprocess.run([sys.executable, "-m", "tapml.cli", "devices", "--registry", registry, "--json", "-",
                                "--timeout", "1"], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr  # not exit 3 (TypeError on features: 5)
            rows = json.loads(r.stdout)
        assert len(rows) == len(announced)
        assert all(row["platform"] == "?" and row["features"] == [] for row in rows), rows
    finally:
        for s in listeners:
            s.close()
        reg.send_signal(signal.SIGTERM)
        reg.wait(10)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        try:
            kids = _children(todo.pop())
        except FileNotFoundError:
            continue
        out += kids
        todo += kids
    return out


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.xdist_group("browser")
def test_killed_browser_behind_a_server_gives_error_verdicts(mlp):
    """`tapml serve --platform browser`: Chromium killed between cases of a remote replay. The
    cases after it are `error` (device lost), never `unsupported` or `mismatch`."""
    import shutil
    if shutil.which("chromium") is None and not os.environ.get("TAPML_CHROMIUM"):
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    from tapml.remote.launcher import ServerProcess
    from tapml.driving.replay import replay
    srv = ServerProcess(platform="browser", token=TOKEN)
    seen = []

    def on_case(v):
        seen.append(v)
        if len(seen) == 1:
            for pid in _descendants(srv.proc.pid):
                with open(f"/proc/{pid}/comm") as f:
                    if "chrom" in f.read():
                        os.kill(pid, signal.SIGKILL)

    try:
        with remote(srv.port) as platform:
            result = replay(mlp, platform, srv.target, on_case=on_case)
    finally:
        srv.stop()
    assert result["cases"][0]["status"] == "pass"
    later = result["cases"][1:]
    assert later and all(v["status"] == "error" and "device lost" in v["message"] for v in later), later


@pytest.mark.slow
def test_killed_device_worker_in_a_registry_pool_gives_error_verdicts(mlp):
    """registry://: a pool device whose worker dies under a case gives that case `error` (naming the
    dead worker), never `unsupported` or `mismatch`; the other cases pass."""
    import re

    from tapml.remote.launcher import ServerProcess
    from tapml.driving.replay import replay
    from tapml.driving.targets import open_target
    reg = subprocess.Popen([sys.executable, "-m", "tapml.cli", "registry", "--port", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    udp = re.search(r"listening on (udp://\S+)", reg.stdout.readline()).group(1)
    srv = ServerProcess(platform="reference", token=TOKEN, args=("--register", udp))
    seen = []

    def on_case(v):
        seen.append(v)
        if len(seen) == 1:  # the next case's request finds the worker stopped, then killed
            worker = _children(srv.proc.pid)[0]
            os.kill(worker, signal.SIGSTOP)
            threading.Timer(1.0, os.kill, (worker, signal.SIGKILL)).start()

    try:
        target = "registry://" + udp.removeprefix("udp://")
        deadline = time.monotonic() + 30
        while True:
            try:
                platform = open_target(target, token=TOKEN)
                break
            except TapmlError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        with platform:
            result = replay(mlp, platform, target, on_case=on_case)
    finally:
        srv.stop()
        reg.send_signal(signal.SIGTERM)
        reg.wait(10)
    statuses = [c["status"] for c in result["cases"]]
    assert set(statuses) <= {"pass", "error"}, statuses
    errors = [c for c in result["cases"] if c["status"] == "error"]
    assert errors and all("device worker died" in c["message"] for c in errors), errors
