"""The IREE backend (`iree:vulkan`, `iree:llvm-cpu`; issue #30): real IREE compiles and runs, on the CPU
(local-task) in the fast tier and on lavapipe Vulkan in the device tier; whole stores, migration,
generation and a device server over it in the slow tier (IREE compiles one op in 0.3-0.7 s)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import replay_each_computing_op
from test_readme import flat, readme_commands, shown_outputs

pytest.importorskip("iree.runtime", reason="the backends extra is not installed (pip install 'tapml[backends]')")

from tapml.platforms.backend import BackendRefused, Compiled  # noqa: E402
from tapml.platforms.iree import IreeBackend, pack_blob, unpack_blob  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ON_VULKAN = [pytest.mark.device, pytest.mark.xdist_group("wgpu")]


@pytest.fixture(scope="module", autouse=True)
def own_compile_cache(tmp_path_factory):
    """This module's compile cache (the commands it runs inherit it): never the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TAPML_CACHE_DIR", str(tmp_path_factory.mktemp("iree-cache")))
        yield


def tapml(*args, timeout=900, env=None):
    """The tapml CLI in a subprocess (a backend runs in a worker process of its own anyway)."""
    return subprocess.run([sys.executable, "-m", "tapml.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def exported(fn, *args):
    class Program(torch.nn.Module):
        def forward(self, *inputs):
            return fn(*inputs)
    return torch.export.export(Program(), args).run_decompositions()


def mixed(x, w, ids, mask):
    """Outputs of four dtypes from bfloat16, int64 and bool inputs."""
    y = x @ w
    return y, ids * 3 + 1, y > 0, torch.where(mask, ids.to(torch.float32), -1.0)


MIXED_INPUTS = (torch.randn(3, 4).to(torch.bfloat16), torch.randn(4, 5).to(torch.bfloat16),
                torch.tensor([7, -2, 1 << 40]), torch.tensor([True, False, True]))


@pytest.fixture(scope="module")
def cpu():
    backend = IreeBackend("iree:llvm-cpu")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def compiled_mixed(cpu):
    return cpu.compile(exported(mixed, *MIXED_INPUTS))


def test_llvm_cpu_compiles_and_runs_mixed_dtypes_exactly_as_torch(cpu, compiled_mixed):
    assert isinstance(compiled_mixed, Compiled) and compiled_mixed.artifact_name == "program.mlir"
    assert b"torch.aten.mm" in compiled_mixed.artifact  # the route's own input, kept for a repro
    out = cpu.run(compiled_mixed, list(MIXED_INPUTS))
    expected = mixed(*MIXED_INPUTS)
    assert [(o.dtype, o.shape) for o in out] == [(e.dtype, e.shape) for e in expected]
    torch.testing.assert_close(out[0], expected[0], rtol=1e-2, atol=1e-2)
    for got, want in zip(out[1:], expected[1:]):
        assert torch.equal(got, want)  # int64 past 2**32, bool and selected values exact
    again = cpu.run(Compiled(handle=cpu.load(compiled_mixed.blob)), list(MIXED_INPUTS))
    assert all(torch.equal(a, b) for a, b in zip(again, out))  # a cached blob runs without compiling


def test_batch_norm_compiles_as_iree_turbines_own_route_decomposes_it(cpu):
    """Core ATen keeps `_native_batch_norm_legit_no_training`, which IREE's torch front end does not lower;
    iree-turbine decomposes it for the modules it exports itself, and the backend does the same for the
    programs tapml hands it (zoo:cnn's batch norms were `unsupported` on IREE before)."""
    g = torch.Generator().manual_seed(3)
    x, mean, var = torch.randn(2, 8, 5, 5, generator=g), torch.randn(8, generator=g), torch.rand(8, generator=g) + 0.5
    weight, bias = torch.randn(8, generator=g), torch.randn(8, generator=g)
    norm = lambda *a: torch.ops.aten._native_batch_norm_legit_no_training.default(*a, 0.1, 1e-5)[0]  # noqa: E731
    program = exported(norm, x, weight, bias, mean, var)
    assert "_native_batch_norm_legit_no_training" in str(program.graph)
    (out,) = cpu.run(cpu.compile(program), [x, weight, bias, mean, var])
    torch.testing.assert_close(out, norm(x, weight, bias, mean, var), rtol=1e-5, atol=1e-5)


def test_zero_dimensional_bfloat16_outputs_keep_their_shape(cpu):
    program = exported(lambda x: (torch.full([], -3.0, dtype=torch.bfloat16), x.sum()), MIXED_INPUTS[0])
    out = cpu.run(cpu.compile(program), [MIXED_INPUTS[0]])
    assert [(o.shape, o.dtype) for o in out] == [(torch.Size([]), torch.bfloat16)] * 2
    assert out[0].item() == -3.0


def test_llvm_cpu_describes_its_device_and_versions(cpu):
    info = cpu.describe()
    assert info["driver"] == "local-task" and "(local-task)" in info["device"]
    assert re.match(r"\d+\.\d+", info["versions"]["iree-base-compiler"])
    assert info["versions"]["iree-base-compiler"] in info["version"] and "llvm-cpu" in info["version"]
    assert cpu.control is None and IreeBackend.control == "iree:llvm-cpu"


def test_the_built_in_targets_name_this_backend_and_only_its_two_forms():
    from tapml.errors import TapmlError
    from tapml.platforms.targets import backend_prefix, load_backend_class
    assert backend_prefix("iree:vulkan") == "iree" and load_backend_class("iree:llvm-cpu") is IreeBackend
    with pytest.raises(TapmlError, match="IreeBackend takes: iree:vulkan, iree:llvm-cpu"):
        load_backend_class("iree:metal")
    with pytest.raises(ValueError, match="not 'iree:metal'"):
        IreeBackend("iree:metal")


def test_outputs_are_held_to_the_programs_dtype_and_shape(cpu, compiled_mixed):
    metas, vmfb = unpack_blob(compiled_mixed.blob)
    wrong_dtype = [dict(m) for m in metas]
    wrong_dtype[1]["dtype"] = "int32"
    with pytest.raises(RuntimeError, match="output 1 is int64, the program's output is torch.int32"):
        cpu.run(Compiled(handle=cpu.load(pack_blob(wrong_dtype, vmfb))), list(MIXED_INPUTS))
    wrong_shape = [dict(m) for m in metas]
    wrong_shape[0]["shape"] = [5, 3]
    with pytest.raises(RuntimeError, match=r"output 0 has shape \[3, 5\]; the program's is \[5, 3\]"):
        cpu.run(Compiled(handle=cpu.load(pack_blob(wrong_shape, vmfb))), list(MIXED_INPUTS))
    with pytest.raises(RuntimeError, match="returned 4 outputs; the program has 3"):
        cpu.run(Compiled(handle=cpu.load(pack_blob(metas[:3], vmfb))), list(MIXED_INPUTS))


@pytest.mark.parametrize("blob, message", [
    (b"", "bad magic"), (b"\x00" * 64, "bad magic"),
    (b"TAPML-IREE-VMFB-1\n\x01", "truncated"),
    (b"TAPML-IREE-VMFB-1\n\xff\xff\xff\x7f{}", "too long"),
    (pack_blob([{"shape": [2], "dtype": "os.system"}], b"x"), "unknown dtype 'os.system'"),
    (pack_blob([{"shape": [2], "dtype": "_dynamo"}], b"x"), "unknown dtype '_dynamo'"),  # no torch attribute lookups
    (pack_blob([{"shape": [2.5], "dtype": "float32"}], b"x"), "malformed output metas"),
    (b"TAPML-IREE-VMFB-1\n" + (14).to_bytes(4, "little") + b'[{"shape":-1}]', "malformed output metas"),
    (b"TAPML-IREE-VMFB-1\n" + (3).to_bytes(4, "little") + b'[{"', "malformed header"),
    (b"TAPML-IREE-VMFB-1\n" + (60000).to_bytes(4, "little") + b"[" * 60000, "malformed header"),  # nests past Python's stack
])
def test_a_blob_that_is_not_ours_is_refused(blob, message):
    with pytest.raises(ValueError, match=message):
        unpack_blob(blob)


def test_a_failing_compile_is_refused_with_iree_compiles_own_error(cpu):
    # IREE's torch frontend has no lowering of aten._fft_r2c
    program = exported(lambda x: (torch.fft.rfft(x).abs(),), torch.randn(8))
    with pytest.raises(BackendRefused) as refused:
        cpu.compile(program)
    message = str(refused.value)
    assert message.startswith("iree-compile failed: failed to legalize operation 'torch.operator'")
    assert "torch.aten._fft_r2c" in message
    assert "Invoked with" not in message and len(message) < 1000
    assert b"torch.aten._fft_r2c" in refused.value.artifact and refused.value.artifact_name == "program.mlir"


def test_the_repro_runner_runs_the_mlir_with_iree_alone(cpu, compiled_mixed):
    namespace = {}
    exec(compile(cpu.repro_runner(), "runner.py", "exec"), namespace)  # noqa: S102 - our own source
    inputs = [t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy() for t in MIXED_INPUTS]
    out = namespace["run"](compiled_mixed.artifact, inputs, ["bfloat16", "bfloat16", "int64", "bool"])
    expected = mixed(*MIXED_INPUTS)
    assert [o.dtype.name for o in out] == ["float32", "int64", "bool", "float32"]
    torch.testing.assert_close(torch.from_numpy(out[0]), expected[0].float(), rtol=1e-2, atol=1e-2)
    assert all((torch.from_numpy(o) == e).all() for o, e in zip(out[1:], expected[1:]))


# -- on lavapipe Vulkan ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vulkan():
    from support import vulkan_or_skip
    vulkan_or_skip()
    backend = IreeBackend("iree:vulkan")
    yield backend
    backend.close()


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_a_closed_vulkan_backend_leaves_no_thread_spinning():
    """iree.runtime keeps the devices it opens in a process-wide cache, and a Vulkan device on lavapipe
    has two threads that spin while it lives: a backend owns its device, so closing it stops them
    (before, every test process that had opened one burnt both cores to its end)."""
    import gc
    import time
    from support import vulkan_or_skip
    vulkan_or_skip()

    def busy_seconds(window: float = 1.0) -> float:
        start = os.times()
        time.sleep(window)
        end = os.times()
        return (end.user + end.system) - (start.user + start.system)

    backend = IreeBackend("iree:vulkan")
    ones = [torch.ones(4, 4), torch.ones(4, 4)]
    assert torch.equal(backend.run(backend.compile(exported(lambda a, b: (a @ b,), *ones)), ones)[0], ones[0] * 4)
    backend.close()
    gc.collect()
    assert busy_seconds() < 0.2  # an idle process; the spinning threads took 2 CPU-seconds a second


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_vulkan_compiles_for_the_adapter_it_opens_and_reads_results_back(vulkan):
    info = vulkan.describe()
    assert info["driver"] == "vulkan" and "llvmpipe" in info["device"]  # lavapipe names its device llvmpipe
    assert "--iree-vulkan-target=llvmpipe" in info["compile_flags"] and vulkan.control == "iree:llvm-cpu"
    out = vulkan.run(vulkan.compile(exported(mixed, *MIXED_INPUTS)), list(MIXED_INPUTS))
    expected = mixed(*MIXED_INPUTS)
    torch.testing.assert_close(out[0], expected[0], rtol=1e-2, atol=1e-2)
    assert all(torch.equal(got, want) for got, want in zip(out[1:], expected[1:]))  # read back past to_host()


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_bfloat16_mm_does_not_compile_for_vulkan_but_does_for_its_control(vulkan, cpu):
    args = (torch.randn(8, 64).to(torch.bfloat16), torch.randn(64, 64).to(torch.bfloat16))
    program = exported(lambda x, w: (x @ w,), *args)
    with pytest.raises(BackendRefused, match=r"failed to legalize operation 'vector.bitcast'.*\(at torch.aten.mm\)"):
        vulkan.compile(program)
    out = cpu.run(cpu.compile(program), list(args))  # the route is sound: the Vulkan compiler is at fault
    torch.testing.assert_close(out[0], args[0] @ args[1], rtol=2e-2, atol=2e-2)


# -- end to end (slow: IREE compiles each case, 0.3-0.7 s apiece) -----------------------------------

def readme_iree_example() -> tuple[str, str]:
    """``(carve command, case id)`` of README.md's IREE example: its carve line, and the case its shown
    output names first (tests/test_readme.py parses both)."""
    text = (ROOT / "README.md").read_text()
    lines, shown = next((lines, shown) for lines, shown in shown_outputs(text) if "iree:vulkan" in shown[0])
    commands = {number: command for number, command, *_ in readme_commands(text)}
    return next(commands[n] for n in lines if " carve " in commands[n]), shown[0].split()[0]


@pytest.mark.slow
@pytest.mark.device
def test_the_repro_of_the_readmes_addmm_case_fails_the_same_way_with_iree_alone(vulkan, tmp_path):
    """The case the README's IREE example shows (tests/test_readme.py walks its commands and checks
    what they print): its repro keeps the MLIR and fails the same way with IREE alone (its own runner)."""
    carve, case = readme_iree_example()
    env = {**os.environ, "T": f"{sys.executable} -m tapml.cli"}
    done = subprocess.run(carve, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    done = subprocess.run(f"$T repro {carve.split()[-1]} {case} --target iree:vulkan -o repro && cd repro && "
                          f"{sys.executable} run.py", shell=True, cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 1 and "failed to legalize operation 'vector.bitcast'" in done.stdout + done.stderr
    assert b"torch.aten.mm" in (tmp_path / "repro" / "program.mlir").read_bytes()  # core ATen: addmm is mm, mul, add


def replay_json(store, *args, timeout=900) -> tuple[int, dict, str]:
    out = Path(store).parent / "verdicts.json"
    done = tapml("replay", store, *args, "--json", out, timeout=timeout)
    assert "Traceback" not in done.stdout + done.stderr
    return done.returncode, json.loads(out.read_text()), done.stdout + done.stderr


# The bfloat16 zoo:mlp's every case on iree:vulkan runs in the migration test below (its op stage), and the
# README's example replays its addmm cases on both targets. Here each computing op's first case: every
# case is an iree-compile of its own (the test took 326-467 s with the views, 298 s with each computing
# case), and the generate test below compiles them all in whole-model programs, every step judged.
@pytest.mark.slow
def test_every_computing_op_of_the_float32_tiny_llama_passes_on_llvm_cpu(carved):
    cases, doc = replay_each_computing_op(carved("zoo:tiny-llama"), "iree:llvm-cpu")
    assert len(cases) >= 25 and len(doc["cases"]) == len(cases)
    assert [(c["op"], c["status"]) for c in doc["cases"] if c["status"] != "pass"] == []
    assert "(local-task)" in doc["device"]["adapter"]


@pytest.mark.slow
@pytest.mark.device
def test_a_device_server_serves_iree_vulkan_to_remote_replays(vulkan, carved):
    from tapml.remote.launcher import ServerProcess
    store = carved("zoo:mlp")
    with ServerProcess(platform="iree:vulkan", startup_s=180) as server:
        assert any("iree:vulkan (llvmpipe" in line for line in server.lines)  # the adapter IREE opened
        code, doc, said = replay_json(store, "--target", f"remote://{server.host}:{server.port}",
                                      "--op", "aten.addmm.default", "--op", "aten.relu.default")
    assert code == 0 and doc["summary"]["pass"] == len(doc["cases"]) >= 3, said[-3000:]
    assert "llvmpipe" in doc["device"]["adapter"]


@pytest.mark.slow
def test_generate_on_llvm_cpu_checks_every_step_and_says_the_cache_goes_back_in(tmp_path):
    done = tapml("generate", "zoo:tiny-llama", "--target", "iree:llvm-cpu", "--tokens", "8",
                 "--json", tmp_path / "g.json", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "g.json").read_text())
    assert [s["status"] for s in doc["steps"]] == ["pass"] * 9 and doc["summary"]["steps"] == 9
    assert [s["kind"] for s in doc["steps"]] == ["prefill"] + ["decode"] * 8
    assert doc["kv_cache"]["on_device"] is False and doc["kv_cache"]["bytes"] > 0
    assert flat(done.stdout).count("KV cache") == 1 and "passed back in with every step" in flat(done.stdout)


@pytest.mark.slow
@pytest.mark.device
def test_migrate_on_iree_vulkan_killed_and_resumed_ends_with_a_placement_and_culprits(vulkan, tmp_path):
    import signal
    import time
    state = tmp_path / "s.json"
    journal = tmp_path / "s.json.journal"
    # zoo:mlp in bfloat16: 10 cases, its two addmm refused by IREE's Vulkan code generator (every IREE
    # compile takes 1.5-4 s here, so a larger model only repeats this at minutes a run)
    command = [sys.executable, "-m", "tapml.cli", "migrate", "zoo:mlp", "--dtype", "bfloat16",
               "--target", "iree:vulkan", "--state", state]
    first = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)  # its own group: the kill takes the IREE worker too
    try:
        deadline = time.monotonic() + 600
        while not (journal.exists() and journal.read_text().count("\n") >= 4):
            assert first.poll() is None, first.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the migration wrote no 4 verdicts in 10 minutes"
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        first.wait()
    done = tapml("migrate", "zoo:mlp", "--dtype", "bfloat16", "--target", "iree:vulkan", "--state", state,
                 "--resume", timeout=1800)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # a finding, not a crash
    doc = json.loads(state.read_text())
    assert doc["complete"] and doc["placement"]
    store_cases = json.loads((tmp_path / "s.store" / "manifest.json").read_text())["cases"]
    assert len(doc["cases"]) == len(store_cases)  # every case of the bfloat16 store ran, 4 of them before the kill
    unsupported = [c for c in doc["cases"] if c["status"] == "unsupported"]
    assert [c for c in doc["cases"] if c["status"] not in ("pass", "unsupported")] == []
    assert "aten.addmm.default" in {c["op"] for c in unsupported}  # bfloat16 addmm: IREE's Vulkan code generator
    assert all("failed to legalize operation 'vector.bitcast'" in c["message"] for c in unsupported)
    assert doc["culprits"] and {c["kind"] for c in doc["culprits"]} >= {"unsupported"}
    fell_back = [n for n, where in doc["placement"]["nodes"].items() if where != "target"]
    assert fell_back and len(fell_back) < len(doc["placement"]["nodes"])  # the rest runs on IREE
    assert "iree:vulkan" in flat(done.stdout) and "culprit" in flat(done.stdout).lower()


def test_time_resident_times_runs_on_device_buffers_and_grows_with_the_work(cpu):
    """`tapml bench --target A --target B` compares compilers without their host transfers through
    :meth:`Backend.time_resident`; IREE's times runs on device arrays made once."""
    def product(n):
        gen = torch.Generator().manual_seed(n)
        a, b = torch.rand(n, n, generator=gen), torch.rand(n, n, generator=gen)
        compiled = cpu.compile(exported(lambda x, y: (x @ y,), a, b))
        torch.testing.assert_close(cpu.run(compiled, [a, b])[0], a @ b)
        return cpu.time_resident(compiled, [a, b], 3)
    small, large = product(32), product(384)
    assert 0 < small < large < 60  # 1728 times the multiply-adds
