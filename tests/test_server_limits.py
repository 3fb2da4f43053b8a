"""What a device server refuses and how it bounds work: real `tapml serve` subprocesses on loopback.

Ops outside the closed vocabulary never run (no file is read or created for a client), programs
over the invocation or buffer caps are refused before they reach the device, a run past
--run-timeout ends as an error for its client while others are served, and SIGTERM stops the
server within seconds even with a run in flight.
"""

import json
import os
import signal
import threading
import time

import pytest
import torch

from tapml.errors import PlatformError, TapmlError, Unsupported

TOKEN = "server limits token"
STOP_BOUND_S = 8.0  # STOP_GRACE_S (3 s) plus process teardown on a loaded 2-core machine


def remote(srv, **kwargs):
    from tapml.remote.client import RemotePlatform
    return RemotePlatform(srv.host, srv.port, token=TOKEN, **kwargs)


def server(platform="reference", *args):
    from tapml.remote.launcher import ServerProcess
    return ServerProcess(platform=platform, token=TOKEN, args=args)


def from_file_graph(path: str, shared: bool):
    from tapml.graph import Graph, Node, TensorMeta
    meta = TensorMeta((16,), "uint8")
    node = Node(name="f", op="aten.from_file.default", args=[path], outputs=[meta],
                kwargs={"shared": shared, "size": 16, "dtype": {"dtype": "uint8"}})
    return Graph(inputs=[], nodes=[node], outputs=["f"])


def mm_chain(n: int, size: int):
    """x @ x @ x ... (n matmuls of size x size): seconds of CPU work for the reference (400 of 1024 took 2.4 s
    here on a quiet day: a run meant to pass a limit of seconds takes 2000)."""
    from tapml.graph import Graph, Node, TensorMeta
    meta = TensorMeta((size, size), "float32")
    nodes, prev = [], "x"
    for i in range(n):
        nodes.append(Node(name=f"m{i}", op="aten.mm.default", args=[{"ref": prev}, {"ref": "x"}], kwargs={},
                          outputs=[meta]))
        prev = f"m{i}"
    return Graph(inputs=[("x", meta)], nodes=nodes, outputs=[prev])


def loop_program(iterations: int, groups=(1, 1, 1), workgroup: int = 1):
    """A hand-made WGSL program: y[0] = x[0] + 0.5 (1.5 for x = 1), after each of ``groups`` x
    ``workgroup`` invocations ran a loop of ``iterations`` (< 2**32) steps of a generator whose
    result the compiler cannot predict, so the loop is not optimized away. (lavapipe ends any
    invocation's loops after 65535 iterations; invocations times that is still hours of work.)"""
    from tapml.graph import TensorMeta
    from tapml.platforms.base import BufferSpec, Kernel, KernelProgram
    meta = TensorMeta((1,), "float32")
    wgsl = f"""
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size({workgroup})
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
  var acc: u32 = bitcast<u32>(x[0]) + gid.x;
  for (var i: u32 = 0u; i < {iterations}u; i = i + 1u) {{ acc = acc * 1664525u + 1013904223u + i; }}
  if (gid.x == 0u && gid.y == 0u && gid.z == 0u) {{ y[0] = x[0] + 0.5; }}
  if (acc == 12345u) {{ y[0] = 7.0; }}
}}
"""
    return KernelProgram(kind="wgsl", inputs=["x"], outputs=["y"],
                         buffers=[BufferSpec("x", "f32", 4, "input", meta), BufferSpec("y", "f32", 4, "output", meta)],
                         kernels=[Kernel("loop", wgsl, [("x", "read"), ("y", "read_write")], tuple(groups))],
                         input_meta=[meta], output_meta=[meta])


def endless_program():
    """Hours of work on any device, yet within the default invocation cap (65535 x 16 x 64)."""
    return loop_program(4_000_000_000, groups=(65535, 16, 1), workgroup=64)


def vulkan_server(*args):
    try:
        return server("wgpu:vulkan", *args)
    except RuntimeError as e:
        if "no Vulkan" in str(e) or "wgpu found no" in str(e):
            pytest.skip(f"no Vulkan adapter: {e}")
        raise


def one() -> torch.Tensor:
    return torch.ones(1)


# --- the op vocabulary ------------------------------------------------------------------------

def test_from_file_is_refused_and_touches_no_file(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret bytes 16b")
    created = tmp_path / "created"
    before = secret.stat()
    srv = server()
    try:
        with remote(srv) as platform:
            for graph in (from_file_graph(str(secret), False), from_file_graph(str(created), True)):
                assert "vocabulary" in platform.supports(graph.nodes[0])
                with pytest.raises(Unsupported, match="aten.from_file.default.*refused"):
                    platform.compile(graph)
            # The same graph as a program loaded directly (no compile on the server) is refused too.
            from tapml.platforms.base import graph_program
            program = graph_program(from_file_graph(str(created), True))
            reply = json.loads(platform._call("load", program.dumps()))
            assert reply["error"]["kind"] == "unsupported" and "from_file" in reply["error"]["message"]
            reply = json.loads(platform._call("run", program.key, "[]"))
            assert reply["error"]["kind"] == "unknown-program"
            assert platform.server_stats()["runs"] == 0
    finally:
        assert srv.stop() == 0
    assert not created.exists()
    after = secret.stat()
    assert (after.st_atime_ns, after.st_mtime_ns) == (before.st_atime_ns, before.st_mtime_ns)


def test_malformed_and_mismatched_programs_are_refused():
    from tapml.platforms.base import BufferSpec
    srv = server()
    try:
        with remote(srv) as platform:
            wgsl = loop_program(1)  # a reference server runs graph programs only
            reply = json.loads(platform._call("load", wgsl.dumps()))
            assert "runs 'graph' programs" in reply["error"]["message"]
            bad = json.loads(wgsl.dumps())
            bad["kind"] = "graph"
            bad["graph"] = {"inputs": [], "nodes": [], "outputs": []}
            bad["input_meta"] = [{"shape": [-1], "dtype": "float32"}]
            reply = json.loads(platform._call("load", json.dumps(bad)))
            assert reply["error"]["kind"] == "usage" and "shape" in reply["error"]["message"]
            # A count that is not a JSON integer is refused with its path, never truncated by int()
            # before the limits see it (#37): 12.9 bytes is not 12, 1.5 workgroups is not 1.
            for damage, path in ((lambda p: p["buffers"][0].update(size=12.9), "program.buffers[0].size is 12.9"),
                                 (lambda p: p["buffers"][0].update(size=16.0), "program.buffers[0].size is 16.0"),
                                 (lambda p: p["kernels"][0].update(workgroups=[1.5, 1, 1]),
                                  "program.kernels[0].workgroups[0] is 1.5"),
                                 (lambda p: p["kernels"][0].update(workgroups=[1, True, 1]),
                                  "program.kernels[0].workgroups[1] is True")):
                doctored = json.loads(wgsl.dumps())
                damage(doctored)
                reply = json.loads(platform._call("load", json.dumps(doctored)))
                assert reply["error"]["kind"] == "usage", reply
                assert reply["error"]["message"] == f"malformed program: {path}: input should be a valid integer", reply
    finally:
        assert srv.stop() == 0
    from tapml.remote.limits import ServerLimits, check_program
    limits = ServerLimits()
    program = loop_program(1)
    assert check_program(program, limits, "wgsl") == {"invocations": 1, "buffer_bytes": 16}
    # types, closed sets and bounds are the program's declared schema: refused on reading, by path
    from tapml.platforms.base import KernelProgram
    for field, value, message in (("size", 6, r"program\.buffers\[0\]\.size is 6: input should be a multiple of 4"),
                                  ("dtype", "f64", r"program\.buffers\[0\]\.dtype is 'f64': input should be 'f32', "),
                                  ("role", "x", r"program\.buffers\[0\]\.role is 'x': input should be 'input', "),
                                  ("name", "", r"program\.buffers\[0\]\.name is '': string should have at least 1")):
        broken = loop_program(1).to_json()
        broken["buffers"][0][field] = value
        with pytest.raises(ValueError, match=message):
            KernelProgram.from_json(broken)
    broken = loop_program(1).to_json()
    broken["kernels"][0]["bindings"][0] = [broken["kernels"][0]["bindings"][0][0], "write"]
    with pytest.raises(ValueError, match=r"program\.kernels\[0\]\.bindings\[0\]\[1\] is 'write'"):
        KernelProgram.from_json(broken)
    with pytest.raises(ValueError, match=r"program\.kernels\[0\] lacks wgsl"):
        KernelProgram.from_json({**loop_program(1).to_json(), "kernels": [{"name": "k", "bindings": [], "workgroups": [1, 1, 1]}]})
    with pytest.raises(ValueError, match=r"program\.smuggled.*extra inputs are not permitted"):
        KernelProgram.from_json({**loop_program(1).to_json(), "smuggled": 1})
    broken = loop_program(1)
    broken.kernels[0].bindings.append(("nowhere", "read"))
    with pytest.raises(ValueError, match="nowhere"):
        check_program(broken, limits, "wgsl")
    broken = loop_program(1)
    broken.kernels[0].wgsl = broken.kernels[0].wgsl.replace("@workgroup_size(1)", "@workgroup_size(N)")
    with pytest.raises(ValueError, match="integer literals"):
        check_program(broken, limits, "wgsl")
    broken = loop_program(1)  # a decoy in a comment does not hide the real size
    broken.kernels[0].wgsl = "// @workgroup_size(1) fn main()\n" + broken.kernels[0].wgsl.replace(
        "@workgroup_size(1)", "@workgroup_size(8, 8)")
    assert check_program(broken, limits, "wgsl")["invocations"] == 64
    broken.buffers.append(BufferSpec("c", "f32", 8, "const", None, b"\0" * 4))
    with pytest.raises(ValueError, match="const"):
        check_program(broken, limits, "wgsl")


# --- work caps and the wall clock (reference: no GPU needed) ---------------------------------

def test_buffer_cap_refuses_before_running():
    srv = server("reference", "--max-buffer-mib", "16")
    try:
        with remote(srv) as platform:
            start = time.monotonic()
            with pytest.raises(Unsupported, match="max-buffer-mib"):
                platform.compile(mm_chain(8, 1024))  # 9 tensors of 4 MiB declared
            assert time.monotonic() - start < 5
            program = platform.compile(mm_chain(2, 64))
            x = torch.randn(64, 64)
            (out,) = platform.run(program, [x])
            torch.testing.assert_close(out, x @ x @ x)
    finally:
        assert srv.stop() == 0


def test_run_past_the_timeout_is_an_error_and_the_next_client_is_served():
    srv = server("reference", "--run-timeout", "2", "--max-buffer-mib", "16384")
    try:
        with remote(srv) as slow:
            program = slow.compile(mm_chain(2000, 1024))
            start = time.monotonic()
            with pytest.raises(PlatformError, match="run-timeout"):
                slow.run(program, [torch.randn(1024, 1024)])
            took = time.monotonic() - start
        assert 1.5 < took < 15, took
        with remote(srv) as next_client:
            small = next_client.compile(mm_chain(1, 32))
            x = torch.randn(32, 32)
            torch.testing.assert_close(next_client.run(small, [x])[0], x @ x)
            stats = next_client.server_stats()
            assert stats["sessions"] == 1 and stats["worker_restarts"] == 1
            assert next_client.info["limits"]["run_timeout"] == 2
    finally:
        assert srv.stop() == 0


def test_waiting_client_gets_device_busy_not_a_hang():
    srv = server("reference", "--run-timeout", "3", "--max-buffer-mib", "16384")
    try:
        with remote(srv) as slow, remote(srv) as waiting:
            program = slow.compile(mm_chain(2000, 1024))
            small = waiting.compile(mm_chain(1, 8))
            errors = []
            holder = threading.Thread(target=lambda: errors.append(_run_error(slow, program, torch.randn(1024, 1024))))
            holder.start()
            time.sleep(1.0)
            start = time.monotonic()
            outcome = _run_error(waiting, small, torch.ones(8, 8))
            waited = time.monotonic() - start
            holder.join(30)
            assert "run-timeout" in errors[0]
            # Either the slow run's kill freed the device in time and this run was served, or
            # the wait hit the limit and said so: never a hang past the limit.
            assert outcome is None or "device busy" in outcome, outcome
            assert waited < 3 + 10, waited
    finally:
        assert srv.stop() == 0


def _run_error(platform, program, x):
    try:
        platform.run(program, [x])
    except PlatformError as e:
        return str(e)
    return None


def test_sigterm_stops_the_server_during_a_long_run(figure):
    srv = server("reference", "--run-timeout", "600", "--max-buffer-mib", "16384")
    with remote(srv, timeout=60) as client:
        program = client.compile(mm_chain(2000, 1024))
        running = threading.Thread(target=_run_error, args=(client, program, torch.randn(1024, 1024)), daemon=True)
        running.start()
        time.sleep(2.0)
        assert srv.proc.poll() is None
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(30)
        took = time.monotonic() - start
        running.join(30)
    figure("serve stop after SIGTERM during a run (s)", round(took, 2))
    assert code == 0 and took < STOP_BOUND_S, (code, took)
    assert any("stopped" in line for line in srv.lines)
    assert not _worker_alive(srv.proc.pid)


def _worker_alive(server_pid: int) -> bool:
    """Whether a device worker of the server ``server_pid`` still runs (it must die with it)."""
    time.sleep(0.5)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if b"tapml.remote.device_worker" in cmd and stat.rsplit(")", 1)[1].split()[1] == str(server_pid):
            return True
    return False


def test_serve_rejects_bad_limits():
    import subprocess
    import sys
    for args in (("--max-invocations", "0"), ("--max-buffer-mib", "0"), ("--run-timeout", "-1")):
        r = subprocess.run([sys.executable, "-m", "tapml.cli", "serve", "--platform", "reference", "--port", "0", *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and args[0] in r.stderr, (args, r.stderr)


# --- a real device (lavapipe Vulkan in CI) -----------------------------------------------------

@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_huge_dispatch_is_refused_by_the_cap_while_another_client_is_served():
    srv = vulkan_server()
    try:
        with remote(srv) as attacker, remote(srv) as other:
            huge = loop_program(1, groups=(65535, 65535, 1), workgroup=64)
            refused = []

            def attack():
                start = time.monotonic()
                try:
                    attacker.run(huge, [one()])
                except Unsupported as e:
                    refused.append((str(e), time.monotonic() - start))

            thread = threading.Thread(target=attack)
            thread.start()
            for _ in range(5):
                (y,) = other.run(loop_program(1), [one()])
                assert y.item() == 1.5
            thread.join(30)
            message, took = refused[0]
            assert "max-invocations" in message and str(65535 * 65535 * 64) in message
            assert took < 5, took
            assert other.server_stats()["runs"] == 5
    finally:
        assert srv.stop() == 0


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_endless_shader_ends_at_the_timeout_and_sigterm_stops_a_stuck_device(figure):
    srv = vulkan_server("--run-timeout", "3")
    try:
        with remote(srv) as stuck:
            endless = endless_program()
            from tapml.remote.limits import ServerLimits, check_program
            assert check_program(endless, ServerLimits(), "wgsl")["invocations"] == 65535 * 16 * 64  # under the cap
            start = time.monotonic()
            with pytest.raises(PlatformError, match="run-timeout"):
                stuck.run(endless, [one()])
            assert time.monotonic() - start < 3 + 10
        with remote(srv) as next_client:  # a fresh worker serves the next client correctly
            assert next_client.run(loop_program(1), [one()])[0].item() == 1.5
    finally:
        assert srv.stop() == 0

    srv = vulkan_server("--run-timeout", "600")
    with remote(srv, timeout=60) as stuck:
        running = threading.Thread(target=_run_error, args=(stuck, endless_program(), one()), daemon=True)
        running.start()
        time.sleep(2.0)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(30)
        took = time.monotonic() - start
        running.join(30)
    figure("serve stop after SIGTERM during an endless shader (s)", round(took, 2))
    assert code == 0 and took < STOP_BOUND_S, (code, took)
    assert not _worker_alive(srv.proc.pid)


def test_open_failure_is_a_usage_error():
    from tapml.remote.device_worker import WorkerPlatform
    with pytest.raises(TapmlError):
        WorkerPlatform("reference:cuda" if not torch.cuda.is_available() else "wgpu:dx12")
