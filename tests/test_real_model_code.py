"""Model code as people write it carves: non-tensor inputs, data-dependent shapes, ``x.item()``
in arithmetic and effect tokens, each through ``tapml carve`` on a ``path/file.py:factory`` spec,
then replayed on the reference and, where the ops have lowerings, on lavapipe Vulkan and llvmpipe GL."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from tapml.carving.store import CarveStore
from tapml.cli import app
from tapml.graph import run_graph

FACTORIES = textwrap.dedent('''
    import torch
    from torch import nn


    class Flags(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, scale_up: bool, repeat: int, return_dict=True, name="a", extra=None, gain=1.0):
            y = self.lin(x)
            if scale_up:
                y = y * 2.0
            for _ in range(repeat):
                y = torch.relu(y) + 1.0
            y = y * gain
            return {"y": y} if return_dict else (y, name, repeat)


    def flags():
        torch.manual_seed(0)
        return Flags().eval(), (torch.randn(2, 8), True, 2,
                                {"return_dict": False, "name": "b", "extra": None, "gain": 0.5})


    class Masks(nn.Module):
        def forward(self, x, labels):
            x = x.clone()
            x[labels == 0] += 1.0
            picked = torch.masked_select(x, x > 0.5)
            return x, picked.sum(), torch.nonzero(labels), torch.unique(labels), torch.bincount(labels)


    def masks():
        torch.manual_seed(0)
        return Masks(), (torch.randn(6, 4), torch.tensor([0, 1, 0, 2, 1, 0]))


    class WideMask(nn.Module):
        """torch.export bounds masked_select's size by x's numel, not by the broadcast of x and the
        mask, and its own runtime check then fails on these very inputs (torch's bug)."""

        def forward(self, x, mask):
            return torch.masked_select(x, mask) * 2


    def wide_mask():
        torch.manual_seed(0)
        return WideMask(), (torch.randn(10), torch.rand(2, 10) > 0.3)


    class Item(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            s = x.sum().item()
            return self.lin(x) * s + s


    def item():
        torch.manual_seed(0)
        return Item().eval(), (torch.randn(3, 4),)


    class Effect(nn.Module):
        def forward(self, x):
            torch.ops.aten._print("effect token")
            return x + 1


    def effect():
        return Effect(), (torch.randn(2, 3),)


    class Foreach(nn.Module):
        def forward(self, x, y):
            a, b = torch._foreach_add([x, y], 1.0)
            return a * b


    def foreach():
        return Foreach(), (torch.randn(3), torch.randn(3))
''')

runner = CliRunner()


def tapml(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "models.py"
    path.write_text(FACTORIES)
    return path


def _eager(factories, name):
    from tapml.frontends.models import load_model
    from tapml.frontends.capture import split_inputs
    model, example = load_model(f"{factories}:{name}")
    args, kwargs = split_inputs(example)
    with torch.no_grad():
        out = model(*args, **kwargs)
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)], example


@pytest.fixture(scope="module")
def carved(factories, tmp_path_factory):
    stores = {}

    def get(name):
        if name not in stores:
            out = tmp_path_factory.mktemp(name) / "store"
            r = tapml("carve", f"{factories}:{name}", "-o", out)
            assert r.exit_code == 0, r.output
            stores[name] = CarveStore(out)
        return stores[name]
    return get


def _replay(store, target, tmp_path):
    verdicts = tmp_path / f"{target.replace(':', '-')}.json"
    r = tapml("replay", store.path, "--target", target, "--json", verdicts)
    return r, json.loads(verdicts.read_text())


def _check_store_matches_eager(store, factories, name):
    """The store's graph, run on the store's inputs, gives what the model gives eagerly."""
    expected, _ = _eager(factories, name)
    stored = list(store.model_outputs().values())
    assert len(stored) == len(expected)
    for s, e in zip(stored, expected):
        torch.testing.assert_close(s, e, rtol=0, atol=0)
    rerun = run_graph(store.graph, store.program_inputs())
    for r, e in zip(rerun.values(), expected):
        torch.testing.assert_close(r, e)


def test_a_runtime_check_torch_got_wrong_does_not_stop_the_carve(carved, factories, tmp_path):
    store = carved("wide_mask")
    (picked,) = [n.outputs[0] for n in store.graph.nodes if n.op == "aten.masked_select.default"]
    x, mask = _eager(factories, "wide_mask")[1]
    assert picked.shape == (int(mask.sum()),) and picked.shape[0] > x.numel()
    _check_store_matches_eager(store, factories, "wide_mask")
    r, verdicts = _replay(store, "reference", tmp_path)
    assert r.exit_code == 0 and verdicts["summary"]["pass"] == len(store.cases), r.output


def test_non_tensor_inputs_become_constants(carved, factories, tmp_path):
    store = carved("flags")
    assert [name for name, _ in store.graph.inputs] == ["p_lin_weight", "p_lin_bias", "x"]
    ops = [n.op for n in store.graph.nodes]
    assert ops.count("aten.relu.default") == 2  # repeat=2 unrolled
    muls = [n.args for n in store.graph.nodes if n.op == "aten.mul.Tensor"]
    assert [a[1] for a in muls] == [2.0, 0.5]  # scale_up=True, gain=0.5 from the keyword inputs
    _check_store_matches_eager(store, factories, "flags")
    r, verdicts = _replay(store, "reference", tmp_path)
    assert r.exit_code == 0, r.output
    assert verdicts["summary"]["pass"] == len(verdicts["cases"]) == len(store.cases)


def test_data_dependent_shapes_take_the_real_run_s_sizes(carved, factories, tmp_path):
    store = carved("masks")
    x, labels = _eager(factories, "masks")[1]
    meta = {n.op: n.outputs for n in store.graph.nodes}
    zeros = int((labels == 0).sum())
    assert meta["aten.index.Tensor"][0].shape == (zeros, 4)
    x2 = x.clone()
    x2[labels == 0] += 1.0
    assert meta["aten.masked_select.default"][0].shape == (int((x2 > 0.5).sum()),)
    assert meta["aten.nonzero.default"][0].shape == (int((labels != 0).sum()), 1)
    assert meta["aten._unique2.default"][0].shape == (3,)
    assert meta["aten.bincount.default"][0].shape == (3,)
    _check_store_matches_eager(store, factories, "masks")
    r, verdicts = _replay(store, "reference", tmp_path)
    assert r.exit_code == 0, r.output
    assert verdicts["summary"]["pass"] == len(verdicts["cases"]) == len(store.cases)


def test_item_in_arithmetic_is_the_reference_value(carved, factories, tmp_path):
    store = carved("item")
    (x,) = _eager(factories, "item")[1]
    total = x.sum().item()
    consumers = [n for n in store.graph.nodes if n.op in ("aten.mul.Tensor", "aten.add.Tensor")]
    assert [n.args[1] for n in consumers] == [total, total]
    assert "aten.sum.dim_IntList" in {c["op"] for c in store.cases}  # the op behind .item() is still a case
    _check_store_matches_eager(store, factories, "item")
    r, verdicts = _replay(store, "reference", tmp_path)
    assert r.exit_code == 0, r.output
    assert verdicts["summary"]["pass"] == len(store.cases)


def test_effect_tokens_are_dropped(carved, factories, tmp_path):
    store = carved("effect")
    assert [name for name, _ in store.graph.inputs] == ["x"]
    assert [n.op for n in store.graph.nodes] == ["aten.add.Tensor"]
    assert store.graph.outputs == ["add"]
    _check_store_matches_eager(store, factories, "effect")
    r, _ = _replay(store, "reference", tmp_path)
    assert r.exit_code == 0, r.output


def test_an_unrepresentable_node_exits_2_naming_it(factories, tmp_path):
    r = subprocess.run([sys.executable, "-m", "tapml.cli", "carve", f"{factories}:foreach", "-o",
                        str(tmp_path / "s")], capture_output=True, text=True)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "node _foreach_add" in r.stderr and "aten._foreach_add.Scalar" in r.stderr
    assert not (tmp_path / "s").exists()


def _wgpu_target(backend: str) -> str:
    """``wgpu:BACKEND``, or skip the calling test where this machine has no such adapter."""
    from tapml.platforms.wgpu_native import available_backends
    if backend not in available_backends():
        pytest.skip(f"no wgpu {backend} adapter (mesa-vulkan-drivers gives lavapipe, libegl-mesa0 llvmpipe)")
    return f"wgpu:{backend}"


@pytest.mark.device
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
@pytest.mark.parametrize("name", ["flags", "masks", "item", "wide_mask"])
def test_replays_on_wgpu(carved, name, backend, tmp_path):
    store = carved(name)
    r, verdicts = _replay(store, _wgpu_target(backend), tmp_path)
    assert r.exit_code == (1 if verdicts["summary"]["unsupported"] else 0), r.output  # a finding, not a crash
    statuses = {c["op"]: c["status"] for c in verdicts["cases"]}
    assert set(statuses.values()) <= {"pass", "unsupported"}
    lowered = {"aten.addmm.default", "aten.mul.Tensor", "aten.add.Tensor", "aten.relu.default",
               "aten.clone.default", "aten.eq.Scalar", "aten.gt.Scalar", "aten.sum.dim_IntList",
               # data-dependent sizes, run with the sizes the carve recorded
               "aten.index.Tensor", "aten.index_put.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten.bincount.default"}
    assert all(statuses[op] == "pass" for op in lowered & set(statuses)), statuses
    assert verdicts["summary"]["pass"] == len(store.cases), statuses


@pytest.mark.device
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
def test_item_model_migrates_on_wgpu(carved, backend, tmp_path):
    store = carved("item")
    r = tapml("migrate", store.path, "--target", _wgpu_target(backend), "--state", tmp_path / "state.json")
    assert r.exit_code == 0, r.output
    assert "end to end: pass" in r.output
