"""Generation at runtime: state (the key/value cache) kept resident on the target across steps.

Fast tier: the ResidentTensor plumbing of Platform.run on the reference platform and on a tiny
hand-made graph with state. Device tier (lavapipe Vulkan, llvmpipe GL, a loopback ``tapml
serve``) and browser tier (headless Chromium): every step of a zoo:tiny-llama generation on the
target through HybridRunner.step, logits equal to the reference's, decode steps uploading only
their token id and position, and as many programs compiled for 2 tokens as for 4; a server
whose device worker is killed mid-generation fails the next step clearly.
"""

from __future__ import annotations

import pytest
import torch

from tapml.carving import CarveStore
from tapml.carving.generation import carve_generation
from tapml.judging.compare import compare_tensor
from tapml.errors import PlatformError
from tapml.graph import Graph, Node, TensorMeta, step
from tapml.driving.hybrid import HybridRunner
from tapml.platforms.base import ResidentTensor
from tapml.platforms.reference import ReferencePlatform

PROMPT_LEN = 5
#: a decode step's own inputs on the device: input_ids [1, 1] and cache_position [1], as i32
DECODE_STEP_BYTES = 8


def counter_graph() -> Graph:
    """``total' = total + x`` (state ``total``), output ``y = total' * 2``."""
    f32 = TensorMeta((4,), "float32")
    nodes = [Node("acc", "aten.add.Tensor", [{"ref": "total"}, {"ref": "x"}], {}, [f32]),
             Node("y", "aten.mul.Tensor", [{"ref": "acc"}, 2.0], {}, [f32])]
    return Graph(inputs=[("total", f32), ("x", f32)], nodes=nodes, outputs=["y", "acc"], state={"total": "acc"})


def _check_counter(platform):
    graph = counter_graph()
    runner = HybridRunner(graph, platform)
    placement = {n.name: "target" for n in graph.nodes}
    xs = [torch.arange(4, dtype=torch.float32) * k for k in range(1, 4)]
    state, expected = {"total": torch.ones(4)}, {"total": torch.ones(4)}
    for x in xs:
        out, state = runner.step({"x": x}, state, placement)
        ref_out, expected = step(graph, {"x": x}, expected)
        assert isinstance(state["total"], ResidentTensor)
        assert torch.equal(out["y"], ref_out["y"])
    assert torch.equal(runner.to_host(state["total"]), expected["total"])
    assert runner.programs_compiled == 1
    # the state crosses to the host when its consumer runs on the reference
    out, state = runner.step({"x": xs[0]}, state, {"y": "target"})
    ref_out, expected = step(graph, {"x": xs[0]}, expected)
    assert torch.equal(out["y"], ref_out["y"]) and torch.equal(state["total"], expected["total"])
    assert not isinstance(state["total"], ResidentTensor)


def test_state_stays_resident_on_the_reference_platform():
    _check_counter(ReferencePlatform())


def test_resident_handles_are_checked():
    platform = ReferencePlatform()
    graph = counter_graph()
    program = platform.compile(graph)
    x = torch.ones(4)
    y, acc = platform.run(program, [torch.zeros(4), x], keep=[1])
    assert isinstance(acc, ResidentTensor) and acc.shape == (4,) and acc.nbytes == 16
    assert torch.equal(platform.read(acc), x)
    _, acc2 = platform.run(program, [acc, x], keep=[1])
    assert torch.equal(platform.read(acc2), 2 * x)
    with pytest.raises(PlatformError, match="stale"):
        platform.run(program, [acc, x])
    with pytest.raises(ValueError, match="another platform"):
        ReferencePlatform().run(program, [acc2, x])
    with pytest.raises(ValueError, match="keep"):
        platform.run(program, [x, x], keep=[2])
    with pytest.raises(TypeError):
        platform.read(x)


def test_step_needs_state():
    graph = counter_graph()
    with pytest.raises(ValueError, match="state values"):
        HybridRunner(graph, ReferencePlatform()).step({"x": torch.ones(4)}, {}, {})
    graph.state = {}
    with pytest.raises(ValueError, match="no state|has none"):
        HybridRunner(graph, ReferencePlatform()).step({"x": torch.ones(4)}, {}, {})


def test_server_checks_every_field_of_a_run_request():
    from tapml.remote.server import OUTPUT_SLOTS, parse_run_request
    assert parse_run_request([3, 4]) == ([3, 4], [])
    assert parse_run_request({"inputs": [1, "held", {"resident": 7}], "keep": [2, 0]}) == \
        ([1, "held", {"resident": 7}], [0, 2])
    for bad in ({"inputs": [1], "extra": 1}, {"inputs": "x"}, [OUTPUT_SLOTS], [-1], [True], ["kept"], [1.0],
                [{"resident": "7"}], [{"resident": 1, "x": 2}], {"inputs": [], "keep": [1, 1]},
                {"inputs": [], "keep": [-1]}, {"inputs": [], "keep": "0"}, None, 5):
        with pytest.raises(ValueError, match=r"^run\b"):  # the request's schema names the field
            parse_run_request(bad)
    with pytest.raises(ValueError, match=r"^run\.inputs\[1\] is 1\.0: input should be a valid integer or 'held'"):
        parse_run_request([0, 1.0])
    with pytest.raises(ValueError, match=r"^run\.inputs\[0\]\.resident is '7': input should be a valid integer$"):
        parse_run_request([{"resident": "7"}])


# --- a real generation on the device tiers -----------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """``llama(tokens)`` -> the CarveStore of a zoo:tiny-llama generation, carved once per module."""
    cache = {}

    def get(tokens: int) -> CarveStore:
        if tokens not in cache:
            out = tmp_path_factory.mktemp("gen") / "store"
            carve_generation("zoo:tiny-llama", out, tokens=tokens, prompt_len=PROMPT_LEN)
            cache[tokens] = CarveStore(out)
        return cache[tokens]
    return get


def generate_on(platform, store: CarveStore) -> tuple[list[int], int]:
    """Every step of ``store`` on ``platform`` (teacher-forced, all on the target); asserts each
    step's logits; returns (bytes uploaded per step, programs compiled)."""
    runners = {k: HybridRunner(store.step_graph(k), platform) for k in ("prefill", "decode")}
    params = {k: store.program_inputs(k) for k in runners}
    state = {name: params["prefill"][name] for name in runners["prefill"].graph.state}
    uploads = []
    for s in store.steps:
        runner = runners[s["kind"]]
        graph = runner.graph
        inputs = {k: v for k, v in params[s["kind"]].items() if k not in graph.state} | store.step_inputs(s["step"])
        before = platform.upload_bytes
        out, state = runner.step(inputs, state, {n.name: "target" for n in graph.nodes})
        uploads.append(platform.upload_bytes - before)
        (logits_ref,) = [r for r in graph.outputs if r not in graph.state.values()]
        logits = out[logits_ref][0, -1]
        res = compare_tensor(logits, store.step_logits(s["step"]))
        assert res.passed, f"step {s['step']} ({s['kind']}): {res.message}"
        assert int(logits.argmax()) == s["token"]
    return uploads, sum(r.programs_compiled for r in runners.values())


def _wgpu(backend):
    from tapml.platforms.wgpu_native import available_backends, shared_platform
    if backend not in available_backends():
        pytest.skip(f"no {backend} adapter here (install mesa-vulkan-drivers / mesa for lavapipe and llvmpipe)")
    return shared_platform(backend)


@pytest.mark.device
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
def test_generation_steps_on_wgpu_keep_the_cache_resident(llama, backend):
    platform = _wgpu(backend)
    uploads, compiled = generate_on(platform, llama(4))
    assert len(uploads) == 5
    # weights and the initial cache go up with the first run of each program; later decode
    # steps send only their token id and position
    assert uploads[0] > 100_000 and uploads[1] > 100_000
    assert uploads[2:] == [DECODE_STEP_BYTES] * 3
    _, compiled2 = generate_on(platform, llama(2))
    assert compiled == compiled2 == 2


#: what a decode step may upload on the browser and remote runtimes: its token id and position
#: (int64 over the wire to a server), nothing of the weights or the cache
DECODE_STEP_MAX_BYTES = 64


def _check_resident_generation(platform, llama):
    """A tokens=4 generation on ``platform`` keeps weights and cache on the device: every step
    passes (generate_on), the decode steps after the first send only their ids and positions,
    and a tokens=2 generation compiles as many programs."""
    uploads, compiled = generate_on(platform, llama(4))
    assert len(uploads) == 5
    assert uploads[0] > 100_000 and uploads[1] > 100_000  # weights and the initial cache, once per program
    assert all(0 < u <= DECODE_STEP_MAX_BYTES for u in uploads[2:]), uploads
    _, compiled2 = generate_on(platform, llama(2))
    assert compiled == compiled2 == 2


def _server_children(pid: int) -> list[int]:
    from pathlib import Path
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


@pytest.mark.device
def test_generation_steps_on_a_loopback_server(llama):
    from tapml.platforms.wgpu_native import available_backends
    from tapml.remote.client import RemotePlatform
    from tapml.remote.launcher import ServerProcess
    if "vulkan" not in available_backends():
        pytest.skip("no vulkan adapter here (install mesa-vulkan-drivers for lavapipe)")
    with ServerProcess(platform="wgpu:vulkan", token="t0ken") as srv:
        with RemotePlatform(srv.host, srv.port, token="t0ken") as platform:
            _check_resident_generation(platform, llama)
            assert platform.stats["bytes_down"] < 64 << 10  # logits only: the cache never came back


@pytest.mark.device
def test_killed_server_worker_mid_generation_is_a_clear_error(llama):
    import os
    import signal
    from tapml.platforms.wgpu_native import available_backends
    from tapml.remote.client import RemotePlatform
    from tapml.remote.launcher import ServerProcess
    if "vulkan" not in available_backends():
        pytest.skip("no vulkan adapter here (install mesa-vulkan-drivers for lavapipe)")
    store = llama(2)
    params = {k: store.program_inputs(k) for k in ("prefill", "decode")}
    with ServerProcess(platform="wgpu:vulkan") as srv, RemotePlatform(srv.host, srv.port) as platform:
        runners = {k: HybridRunner(store.step_graph(k), platform) for k in params}

        def run_step(s, state):
            graph = runners[s["kind"]].graph
            inputs = {k: v for k, v in params[s["kind"]].items() if k not in graph.state} | store.step_inputs(s["step"])
            return runners[s["kind"]].step(inputs, state, {n.name: "target" for n in graph.nodes})

        initial = {name: params["prefill"][name] for name in runners["prefill"].graph.state}
        _, state = run_step(store.steps[0], initial)
        _, state = run_step(store.steps[1], state)
        assert all(isinstance(v, ResidentTensor) for v in state.values())
        (worker,) = _server_children(srv.proc.pid)
        os.kill(worker, signal.SIGKILL)
        # the next step finds the worker dead, or dying (its socket closes as its threads end)
        with pytest.raises(PlatformError, match="worker (was restarted|died during the run)") as err:
            run_step(store.steps[2], state)
        assert "run the generation again from its first step" in str(err.value)
        with pytest.raises(PlatformError, match="no longer holds"):
            platform.read(next(iter(state.values())))
        # started over, the generation runs on a fresh worker
        out, _ = run_step(store.steps[0], initial)
        assert platform.server_stats()["worker_restarts"] == 1
        (logits,) = [r for r in runners["prefill"].graph.outputs if r not in runners["prefill"].graph.state.values()]
        assert compare_tensor(out[logits][0, -1], store.step_logits(0)).passed


@pytest.mark.browser
def test_generation_steps_in_the_browser_keep_the_cache_on_the_page(llama):
    from tapml.platforms.browser import BrowserPlatform
    with BrowserPlatform() as platform:
        _check_resident_generation(platform, llama)
        # a kept output reads back explicitly, equal to what the reference's cache holds
        store = llama(2)
        runner = HybridRunner(store.step_graph("prefill"), platform)
        graph = runner.graph
        params = store.program_inputs("prefill")
        state = {name: params[name] for name in graph.state}
        _, state = runner.step({k: v for k, v in params.items() if k not in graph.state} | store.step_inputs(0),
                               state, {n.name: "target" for n in graph.nodes})
        _, expected = step(graph, {k: v for k, v in params.items() if k not in graph.state} | store.step_inputs(0),
                           {name: params[name] for name in graph.state})
        for name, handle in state.items():
            assert isinstance(handle, ResidentTensor)
            assert compare_tensor(platform.read(handle), expected[name]).passed
        # a page that dropped its programs loses what they kept: a clear error, never garbage
        platform._on_page.clear()
        with pytest.raises(PlatformError, match="no longer holds"):
            platform.read(next(iter(state.values())))
