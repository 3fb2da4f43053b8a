import json
import textwrap

import pytest
import torch

from tapml.carving import CarveStore, carve
from tapml.errors import TapmlError
from tapml.graph import Graph, run_graph
from tapml.frontends.models import load_model


def test_zoo_is_deterministic():
    (m1, x1), (m2, x2) = load_model("zoo:mlp", seed=3), load_model("zoo:mlp", seed=3)
    assert torch.equal(x1[0], x2[0])
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    _, x3 = load_model("zoo:mlp", seed=4)
    assert not torch.equal(x1[0], x3[0])


@pytest.mark.parametrize("spec,match", [
    ("zoo:nope", "unknown zoo model 'nope'"),
    ("hf:not_a_model_type", "unknown transformers model type"),
    ("nonsense", "no store at nonsense.*not a model spec"),
    ("missing.pt2", "does not exist"),
    ("missing.py:factory", "does not exist"),
    ("", "empty model spec"),
])
def test_bad_model_specs_say_what_to_do(spec, match):
    with pytest.raises(TapmlError, match=match):
        load_model(spec)


def test_store_round_trip_and_dedup(carved):
    store = CarveStore(carved("zoo:tiny-llama"))
    m = store.manifest
    for key in ("format_version", "model", "torch_version", "reference_device", "seed", "nodes", "cases"):
        assert key in m
    assert m["model"] == "zoo:tiny-llama" and m["reference_device"] == "cpu"
    ops = {c["op"] for c in store.cases}
    assert len(ops) >= 30
    # Deduplication: every node belongs to exactly one case; instance counts add up.
    assert sum(c["instances"] for c in store.cases) == len(store.graph.nodes)
    assert len(store.cases) < len(store.graph.nodes)
    keys = set()
    for c in store.cases:
        metas = tuple((tuple(store.tensor_index[n]["shape"]), store.tensor_index[n]["dtype"]) for n in c["inputs"])
        key = (c["op"], metas, json.dumps(c["args"]), json.dumps(c["kwargs"], sort_keys=True))
        assert key not in keys
        keys.add(key)
    assert all(n.case for n in store.graph.nodes)
    # Module paths come from nn_module_stack.
    assert any(c["module"].startswith("model.layers.0.self_attn") for c in store.cases)


def test_carved_tensors_are_bit_identical_to_torch(carved):
    store = CarveStore(carved("zoo:tiny-llama"))
    for case in store.cases:
        graph = store.case_graph(case)
        out = run_graph(graph, dict(zip([r for r, _ in graph.inputs], store.case_inputs(case))))
        for ref, expected in zip(graph.outputs, store.case_outputs(case)):
            assert torch.equal(out[ref], expected), case["id"]


def test_whole_graph_reruns_from_the_store(carved):
    store = CarveStore(carved("zoo:cnn"))
    out = run_graph(store.graph, store.program_inputs())
    for ref, expected in store.model_outputs().items():
        assert torch.equal(out[ref], expected)
    assert Graph.from_json(store.graph.to_json()).to_json() == store.graph.to_json()


def test_memory_stays_bounded_with_small_shards(tmp_path):
    shard = 32 << 10  # a store holds each tensor once: tiny-llama is ~600 KB
    info = carve("zoo:tiny-llama", tmp_path / "s", shard_bytes=shard)
    store = CarveStore(tmp_path / "s")
    largest = max(store.tensor(name).nbytes for name in store.tensor_index)
    assert info["shards"] > 10
    # Never more than one shard's worth plus the tensor that tipped it over is held in memory.
    assert info["peak_pending_bytes"] < shard + largest
    assert info["bytes"] > 10 * shard


def test_factory_file_and_pt2_specs(tmp_path):
    (tmp_path / "m.py").write_text(textwrap.dedent("""
        import torch
        def make():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh()), (torch.randn(2, 8),)
        def broken():
            return 3
        def raising():
            raise RuntimeError("weights missing")
    """))
    info = carve(f"{tmp_path}/m.py:make", tmp_path / "s1")
    assert info["ops"] >= 2
    with pytest.raises(TapmlError, match="factory must return"):
        load_model(f"{tmp_path}/m.py:broken")
    with pytest.raises(TapmlError, match="factory raised RuntimeError: weights missing"):
        load_model(f"{tmp_path}/m.py:raising")
    with pytest.raises(TapmlError, match="no function"):
        load_model(f"{tmp_path}/m.py:absent")
    model, inputs = load_model(f"{tmp_path}/m.py:make")
    torch.export.save(torch.export.export(model, inputs), tmp_path / "m.pt2")
    info = carve(str(tmp_path / "m.pt2"), tmp_path / "s2")
    store = CarveStore(tmp_path / "s2")
    assert {c["op"] for c in store.cases} >= {"aten.tanh.default"}
    # the commands that carve on their own take the .pt2 too (they refused it as "a file"), and no other file
    from typer.testing import CliRunner

    from tapml.cli import app
    r = CliRunner().invoke(app, ["migrate", str(tmp_path / "m.pt2"), "--target", "reference", "--state",
                                 str(tmp_path / "st.json"), "-q"])
    assert r.exit_code == 0 and json.loads((tmp_path / "st.json").read_text())["passed"], r.output
    (tmp_path / "notes.txt").write_text("not a model")
    r = CliRunner().invoke(app, ["migrate", str(tmp_path / "notes.txt"), "--target", "reference", "--state",
                                 str(tmp_path / "st2.json")])
    assert r.exit_code == 2 and "is a file, not a carve store or a model spec" in r.output, r.output


def test_model_that_does_not_export_names_the_cause(tmp_path):
    (tmp_path / "bad.py").write_text(textwrap.dedent("""
        import torch
        class Bad(torch.nn.Module):
            def forward(self, x):
                if x.sum() > 0:
                    return x + 1
                return x - 1
        def make():
            return Bad(), (torch.randn(3),)
    """))
    with pytest.raises(TapmlError, match="does not export"):
        carve(f"{tmp_path}/bad.py:make", tmp_path / "s")


def test_hf_architecture_not_named_anywhere_carves(carved):
    store = CarveStore(carved("hf:gpt_neox"))
    assert store.model == "hf:gpt_neox"
    assert any("gpt_neox" in c["module"] or "layers" in c["module"] for c in store.cases)


def test_hf_config_overrides_apply(tmp_path):
    model, _ = load_model("hf:llama", hf_config={"num_hidden_layers": 1, "hidden_act": "gelu"})
    assert model.config.num_hidden_layers == 1 and model.config.hidden_act == "gelu"
    with pytest.raises(TapmlError, match="only applies to hf"):
        load_model("zoo:mlp", hf_config={"a": 1})


UNCARVABLE = textwrap.dedent('''
    import torch


    class Wide(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.complex128).abs().float() + 1


    class Hashing(torch.nn.Module):
        def forward(self, x):
            return (x * 1000).to(torch.uint32).to(torch.int64)


    class Sparse(torch.nn.Module):
        def forward(self, a, b):
            return torch.sparse.mm(a, b)


    def wide():
        return Wide(), (torch.randn(3, 4),)


    def hashing():
        return Hashing(), (torch.randn(3, 4),)


    def sparse():
        return Sparse(), (torch.randn(4, 4).relu().to_sparse(), torch.randn(4, 2))
''')


@pytest.mark.parametrize("factory,expect", [("wide", "makes a complex128 tensor"), ("hashing", "makes a uint32 tensor"),
                                            ("sparse", "sparse tensor")])
def test_a_tensor_no_store_can_hold_is_exit_2_naming_the_node(tmp_path, factory, expect):
    """complex128, uint32 or sparse tensors (a store holds dense float, complex64 and complex32, int,
    uint8, uint64 and bool ones) are refused at carve with the node that makes them, never an
    internal error."""
    from typer.testing import CliRunner
    from tapml.cli import app
    (tmp_path / "m.py").write_text(UNCARVABLE)
    r = CliRunner().invoke(app, ["carve", f"{tmp_path / 'm.py'}:{factory}", "-o", str(tmp_path / "store")])
    assert r.exit_code == 2 and expect in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "store").exists()


def test_the_carvable_dtypes_are_the_store_s():
    from tapml.carving.manifest import STORE_DTYPES
    from tapml.graph import CARVABLE_DTYPES
    assert set(STORE_DTYPES) == CARVABLE_DTYPES
