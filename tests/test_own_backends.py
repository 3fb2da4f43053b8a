"""tapml's own compilers behind the Backend contract (platforms/platform_backend.py): through
``BackendPlatform`` every case gets the status it gets on the target itself, and a backend in the
user's own file that extends ours (one op's output made 1% too large) is what migrate names."""

from __future__ import annotations

import json
import textwrap

import pytest

from support import store_from_source, vulkan_or_skip

#: gelu passes (or, with the fault injected, mismatches); the float64 ops are beyond WGSL (unsupported
#: on wgpu, pass on the reference); the add passes
MODEL = textwrap.dedent('''
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            y = torch.nn.functional.gelu(x)
            return y.double().exp().float() + y

    def factory():
        torch.manual_seed(0)
        return Model(), (torch.randn(4, 16),)
''')

MINE = textwrap.dedent('''
    import torch
    from tapml.platforms.wgpu_backend import WgpuBackend

    class Mine(WgpuBackend):
        """tapml's WGSL compiler on Vulkan, but gelu's output comes out 1% too large."""
        needs = "wgpu and my patience"
        default_form = "wgpu:vulkan"

        def compile(self, program):
            graph = program.graph
            for node in list(graph.nodes):
                if node.op == "call_function" and str(node.target) == "aten.gelu.default":
                    with graph.inserting_after(node):
                        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.01))
                    scaled.meta.update(node.meta)  # the gelu's shape, dtype and module
                    node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
            return super().compile(program)
''')

GELU_WRONG = ["aten.gelu.default=scale:1.01"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return store_from_source(tmp_path_factory, "f64_model", MODEL)


def _statuses(store, platform, target: str) -> dict[str, str]:
    """``{case id: (op, status)}`` of a replay with gelu made wrong, as the CLI runs it (limits preflight
    included). A backend's case is compiled by the replay itself, not ahead by the preflight."""
    from tapml.driving.inject import InjectedPlatform, parse_faults
    from tapml.driving.replay import replay
    doc = replay(store, InjectedPlatform(platform, parse_faults(GELU_WRONG)), target, preflight=lambda report: None)
    timed = [c for c in doc["cases"] if "compile_cached" in c]
    assert all(c["compile_cached"] is False for c in timed), timed
    return {c["id"]: (c["op"], c["status"]) for c in doc["cases"]}


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_wgpu_through_the_contract_gives_the_statuses_of_the_target_itself(store):
    """Every case through BackendPlatform(WgpuBackend) gets its native status (pass, mismatch and
    unsupported among them); refuse names the op, the artifact is WGSL, describe names the adapter."""
    vulkan_or_skip()
    from tapml.graph import graph_from_fx
    from tapml.platforms.external import BackendPlatform, export_graph
    from tapml.platforms.targets import open_platform
    from tapml.platforms.wgpu_backend import WgpuBackend
    with open_platform("wgpu:vulkan") as native:
        expected = _statuses(store, native, "wgpu:vulkan")
        adapter = native.caps()["adapter"]
    backend = WgpuBackend("wgpu:vulkan")
    with BackendPlatform(backend, cache=None) as through:
        got = _statuses(store, through, "wgpu:vulkan")
        assert through.caps()["adapter"] == adapter and "shader-f16" in through.caps()["features"]
        # the contract's own calls on one case each: a lowering's WGSL, and a refusal naming its op
        gelu = next(c for c in store.cases if c["op"] == "aten.gelu.default")
        to_f64 = next(c for c in store.cases if c["op"] == "aten._to_copy.default"
                      and store.case_graph(c).nodes[0].outputs[0].dtype == "float64")
        program = export_graph(store.case_graph(gelu))
        assert backend.refuse(program) is None
        compiled = backend.compile(program)
        assert compiled.artifact_name == "kernels.wgsl" and b"@compute" in compiled.artifact
        assert [n.op for n in graph_from_fx(program.graph).nodes] == ["aten.gelu.default"]
        (out,) = backend.run(compiled, store.case_inputs(gelu))
        assert out.shape == store.case_outputs(gelu)[0].shape
        reason = backend.refuse(export_graph(store.case_graph(to_f64)))
        assert reason and reason.startswith("aten._to_copy.default") and "float64" in reason, reason
    assert got == expected
    assert {s for _, s in got.values()} == {"pass", "mismatch", "unsupported"}
    assert [s for op, s in got.values() if op == "aten.gelu.default"] == ["mismatch"]


def test_the_reference_through_the_contract_gives_the_statuses_of_the_target_itself(store, tmp_path):
    """Through BackendPlatform(ReferenceBackend), and as a file backend that extends it (opened the
    way the backend worker opens a ``file.py:Class`` target), every case gets its native status."""
    from tapml.platforms.external import BackendPlatform
    from tapml.platforms.reference_backend import ReferenceBackend
    from tapml.platforms.targets import open_platform
    with open_platform("reference") as native:
        expected = _statuses(store, native, "reference")
    with BackendPlatform(ReferenceBackend("reference"), cache=None) as through:
        got = _statuses(store, through, "reference")
        assert through.last_artifact[0] == "graph.json" and through.caps()["adapter"] == "cpu"
    assert got == expected and {s for _, s in got.values()} == {"pass", "mismatch"}
    mine = tmp_path / "mine.py"
    mine.write_text("from tapml.platforms.reference_backend import ReferenceBackend\n\n"
                    "class Mine(ReferenceBackend):\n    pass\n")
    with open_platform(f"{mine}:Mine") as extended:
        assert isinstance(extended, BackendPlatform) and extended.backend.form == "reference"
        assert _statuses(store, extended, f"{mine}:Mine") == expected


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_a_file_backend_extending_ours_is_listed_and_its_wrong_op_is_the_culprit(tmp_path):
    """``class Mine(WgpuBackend)`` in the user's file: ``tapml targets`` lists it beside our own
    backends, and migrate (in a backend worker) names the op it made wrong, and only that one."""
    vulkan_or_skip()
    from typer.testing import CliRunner

    from tapml.cli import app
    mine = tmp_path / "mine.py"
    mine.write_text(MINE)
    spec = f"{mine}:Mine"
    r = CliRunner().invoke(app, ["targets", spec, "--json", str(tmp_path / "t.json")])
    assert r.exit_code == 0, r.output
    rows = {row["target"]: row for row in json.loads((tmp_path / "t.json").read_text())["targets"]}
    assert rows[spec]["kind"] == "file" and rows[spec]["importable"] and rows[spec]["needs"] == "wgpu and my patience"
    assert rows[spec]["forms"] == [spec] and rows["wgpu"]["kind"] == "own backend"
    r = CliRunner().invoke(app, ["migrate", "zoo:mlp", "--target", spec, "--state", str(tmp_path / "s.json")])
    assert r.exit_code == 1, r.output
    state = json.loads((tmp_path / "s.json").read_text())
    assert {(c["op"], c["kind"]) for c in state["culprits"]} == {("aten.gelu.default", "op")}
    assert state["placement"]["nodes"]["gelu"] == "reference" and state["placement"]["ops_on_target"] == 9
