"""Sorting (platforms/wgsl/sort.py) beyond the registry's generated samples: a router model that
sorts and picks its top k, carved and replayed on the reference and on Vulkan (lavapipe); which
torch sorting functions export as the lowered ops; and the one topk variant that is refused."""

import json
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from tapml.carving.store import CarveStore
from tapml.cli import app
from support import REFERENCE_AND_VULKAN

ROUTER = textwrap.dedent('''
    import torch
    from torch import nn


    class Router(nn.Module):
        """A mixture-of-experts router: the top 2 experts of each token, tokens grouped by expert."""

        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(16, 40)

        def forward(self, x):
            logits = self.gate(x)
            weights, experts = torch.topk(logits.softmax(-1), 2, dim=-1)
            ranking = torch.argsort(logits, dim=-1, descending=True)
            grouped, order = torch.sort(experts.flatten(), stable=True)  # expert ids repeat: ties
            return weights / weights.sum(-1, keepdim=True), experts, ranking, grouped, order, torch.msort(logits)


    def router():
        torch.manual_seed(0)
        return Router().eval(), (torch.randn(300, 16),)
''')


@pytest.fixture(scope="module")
def router_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "router.py"
    path.write_text(ROUTER)
    out = tmp_path_factory.mktemp("router") / "store"
    r = CliRunner().invoke(app, ["carve", f"{path}:router", "-o", str(out)])
    assert r.exit_code == 0, r.output
    return CarveStore(out)


@pytest.mark.parametrize("target", REFERENCE_AND_VULKAN)
def test_router_with_topk_and_sorts_replays(router_store, target, tmp_path):
    ops = {c["op"] for c in router_store.cases}
    assert {"aten.topk.default", "aten.sort.default", "aten.sort.stable"} <= ops
    verdicts = tmp_path / "verdicts.json"
    r = CliRunner().invoke(app, ["replay", str(router_store.path), "--target", target, "--json", str(verdicts)])
    result = json.loads(verdicts.read_text())
    assert r.exit_code == 0, r.output
    sorting = [v for v in result["cases"] if v["op"] in ("aten.topk.default", "aten.sort.default", "aten.sort.stable")]
    assert len(sorting) == 4 and all(v["status"] == "pass" for v in sorting), sorting
    assert result["summary"]["pass"] == len(result["cases"])


def _exported_ops(fn, x) -> list[str]:
    class Wrap(torch.nn.Module):
        def forward(self, x):
            return fn(x)
    ep = torch.export.export(Wrap(), (x,)).run_decompositions()
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and str(n.target).startswith("aten.")]


def test_argsort_and_msort_export_as_sort():
    x = torch.randn(3, 5)
    assert _exported_ops(lambda t: torch.argsort(t, dim=0), x) == ["aten.sort.default"]
    assert _exported_ops(lambda t: torch.argsort(t, stable=True), x) == ["aten.sort.stable"]
    assert _exported_ops(torch.msort, x) == ["aten.sort.default"]


def test_topk_unsorted_is_refused_with_the_reason():
    from tapml.platforms.wgsl import supports
    from tapml.platforms.wgsl.registry import case_graph
    x = torch.randn(4, 9)
    graph, _ = case_graph("aten.topk.default", [x, 3, -1, True, False])
    reason = supports(graph.nodes[0], {}, [graph.meta["x0"]])
    assert reason is not None and "sorted=False" in reason and "unspecified" in reason
    graph, _ = case_graph("aten.topk.default", [x, 3], {"sorted": True})
    assert supports(graph.nodes[0], {}, [graph.meta["x0"]]) is None


TIES = textwrap.dedent('''
    import torch


    class Ties(torch.nn.Module):
        """Rounded scores: many equal values, whose order torch leaves unspecified."""

        def forward(self, x):
            scores = torch.round(x * 2) / 2
            top, where = torch.topk(scores, 5, dim=-1)
            ranked, order = torch.sort(scores, dim=0, descending=True)
            return top, where, ranked, order


    def ties():
        torch.manual_seed(1)
        return Ties(), (torch.randn(6, 64),)
''')


@pytest.mark.device
def test_sort_and_topk_with_ties_pass_when_only_the_order_of_equal_values_differs(tmp_path):
    (tmp_path / "ties.py").write_text(TIES)
    r = CliRunner().invoke(app, ["carve", f"{tmp_path / 'ties.py'}:ties", "-o", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    verdicts = tmp_path / "v.json"
    r = CliRunner().invoke(app, ["replay", str(tmp_path / "s"), "--target", "wgpu:vulkan", "--json", str(verdicts)])
    assert r.exit_code == 0, r.output
    sorting = [v for v in json.loads(verdicts.read_text())["cases"] if v["op"] in ("aten.topk.default", "aten.sort.default")]
    assert len(sorting) == 2 and all(v["status"] == "pass" for v in sorting), sorting
