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

pytest.importorskip("iree.runtime", reason="the backends extra is not installed (pip install 'tapml[backends]')")

from tapml.platforms.backend import BackendRefused, Compiled  # noqa: E402
from tapml.platforms.iree import IreeBackend, pack_blob, unpack_blob  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ON_VULKAN = [pytest.mark.device, pytest.mark.xdist_group("wgpu")]


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
    (pack_blob([{"shape": [2], "dtype": "os.system"}], b"x")[:-1] + b"x", "malformed"),
    (b"TAPML-IREE-VMFB-1\n" + (14).to_bytes(4, "little") + b'[{"shape":-1}]', "malformed output metas"),
    (b"TAPML-IREE-VMFB-1\n" + (3).to_bytes(4, "little") + b'[{"', "malformed header"),
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
