"""Device tier: the backward ops of training graphs on lavapipe Vulkan.

A real training step (a loss's gradients from ``torch.autograd.grad``, traced to ATen with the
seven backward ops kept whole) is compiled as one graph and its gradients are checked against
autograd; a model whose forward writes its backward out with those ops is carved and migrated;
and a node that lists only the gradients its ``output_mask`` wants gets exactly those, as in a
training program from torch's own forward-and-backward export (carved and migrated on Vulkan and GL).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.device, pytest.mark.xdist_group("wgpu")]

aten = torch.ops.aten
BACKWARD_OPS = ("aten.embedding_dense_backward.default", "aten.avg_pool2d_backward.default",
                "aten.max_pool2d_with_indices_backward.default", "aten._adaptive_avg_pool2d_backward.default",
                "aten.native_layer_norm_backward.default", "aten.native_group_norm_backward.default",
                "aten.convolution_backward.default")


@pytest.fixture(scope="module")
def vulkan():
    from tapml.platforms.wgpu_native import available_backends, shared_platform
    if "vulkan" not in available_backends():
        pytest.skip("no Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")
    return shared_platform("vulkan")


class TinyNet(nn.Module):
    """Embedding + LayerNorm beside Conv + GroupNorm + max, avg and adaptive avg pooling."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln = nn.Embedding(10, 8), nn.LayerNorm(8)
        self.conv, self.gn = nn.Conv2d(2, 4, 3, padding=1, stride=1), nn.GroupNorm(2, 4)

    def forward(self, x, ids):
        y = nn.functional.max_pool2d(self.gn(self.conv(x)), 2)
        y = nn.functional.adaptive_avg_pool2d(nn.functional.avg_pool2d(y, 2, stride=1), (2, 2)).flatten(1)
        e = self.ln(self.emb(ids)).mean(1)
        return (y.sum(1, keepdim=True) * e).square().mean()


def _training_step_graph(net, x, ids):
    """The ATen graph of ``(loss, dloss/dx, dloss/dparams...)`` for ``net``: autograd traced with
    core ATen's decompositions, less those of the backward ops (and of the adaptive pool)."""
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from tapml.graph import graph_from_fx
    keep = {getattr(aten, op.split(".")[1]).default for op in BACKWARD_OPS} | {aten._adaptive_avg_pool2d.default}
    table = {op: fn for op, fn in core_aten_decompositions().items() if op not in keep}
    names = [n for n, _ in net.named_parameters()]

    def step(x, ids, *params):
        # grads of x too, so every convolution_backward wants all three results (a graph holds no None)
        x = x.detach().requires_grad_(True)
        ps = [p.detach().requires_grad_(True) for p in params]
        with torch.enable_grad():
            loss = torch.func.functional_call(net, dict(zip(names, ps)), (x, ids))
            return (loss, *torch.autograd.grad(loss, [x, *ps]))
    params = [p.detach() for p in net.parameters()]
    gm = make_fx(step, decomposition_table=table, tracing_mode="fake")(x, ids, *params)
    return graph_from_fx(gm.graph), [x, ids, *params]


def test_training_step_gradients_match_autograd_on_vulkan(vulkan):
    from tapml.judging.compare import compare_tensor
    torch.manual_seed(0)
    net = TinyNet()
    x, ids = torch.randn(2, 2, 9, 9), torch.randint(0, 10, (2, 5))
    graph, inputs = _training_step_graph(net, x, ids)
    assert {n.op for n in graph.nodes} >= set(BACKWARD_OPS), sorted({n.op for n in graph.nodes})

    out = vulkan.run(vulkan.compile(graph), inputs)
    xg = x.clone().requires_grad_(True)
    loss = net(xg, ids)
    expected = [loss.detach(), *(g.detach() for g in torch.autograd.grad(loss, [xg, *net.parameters()]))]
    assert len(out) == len(expected)
    for i, (o, e) in enumerate(zip(out, expected)):
        assert o.shape == e.shape and o.dtype == e.dtype, (i, o.shape, e.shape)
        res = compare_tensor(o, e)
        assert res.passed, f"output {i} ({graph.outputs[i]}): {res.message}; worst {res.worst}"
    assert out[3].abs().sum() > 0  # the embedding's gradient is no zeros by accident


TRAINER = textwrap.dedent("""
    import torch
    from torch import nn

    aten = torch.ops.aten


    class HandWrittenStep(nn.Module):
        '''conv -> max pool -> avg pool -> adaptive avg pool, then its backward on an upstream
        gradient, written out with the ops autograd runs (they survive core-ATen decomposition).'''

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1, groups=1)

        def forward(self, x, upstream):
            y = self.conv(x)
            p, ind = aten.max_pool2d_with_indices(y, [2, 2], [2, 2])
            q = aten.avg_pool2d(p, [3, 3], [1, 1], [1, 1])
            r = aten._adaptive_avg_pool2d(q, [2, 2])
            gq = aten._adaptive_avg_pool2d_backward(upstream, q)
            gp = aten.avg_pool2d_backward(gq, p, [3, 3], [1, 1], [1, 1], False, True, None)
            gy = aten.max_pool2d_with_indices_backward(gp, y, [2, 2], [2, 2], [0, 0], [1, 1], False, ind)
            gx, gw, gb = aten.convolution_backward(gy, x, self.conv.weight, [4], [1, 1], [1, 1], [1, 1], False,
                                                   [0, 0], 1, [True, True, True])
            return r, gx, gw, gb


    def factory():
        torch.manual_seed(0)
        return HandWrittenStep().eval(), (torch.randn(2, 3, 8, 8), torch.randn(2, 4, 2, 2))
""")


def test_hand_written_backward_is_carved_and_migrates_to_vulkan(vulkan, tmp_path):
    from tapml.carving import CarveStore, carve
    from tapml.driving.migrate import Migration, exit_code
    (tmp_path / "trainer.py").write_text(TRAINER)
    carve(f"{tmp_path / 'trainer.py'}:factory", tmp_path / "store")
    store = CarveStore(tmp_path / "store")
    carved = {c["op"] for c in store.cases}
    wanted = {"aten.avg_pool2d_backward.default", "aten.max_pool2d_with_indices_backward.default",
              "aten._adaptive_avg_pool2d_backward.default", "aten.convolution_backward.default"}
    assert wanted <= carved, sorted(carved)
    state = Migration(store, vulkan, "wgpu:vulkan", tmp_path / "s.json").run()
    backward = [c for c in state["cases"] if c["op"] in wanted]
    assert len(backward) == 4 and all(c["status"] == "pass" for c in backward), \
        [(c["op"], c["status"], c["message"][:200]) for c in backward]
    assert state["summary"]["pass"] == len(store.cases), state["summary"]
    assert state["end_to_end"]["status"] == "pass" and exit_code(state) == 0


def _masked_graph(op, args, expected):
    """A one-node graph of ``op`` that lists only the results torch returns (not None)."""
    from tapml.graph import Graph, Node, TensorMeta
    inputs = [t for t in args if isinstance(t, torch.Tensor)]
    refs = iter(f"x{i}" for i in range(len(inputs)))
    enc = [{"ref": next(refs)} if isinstance(a, torch.Tensor) else a for a in args]
    node = Node("n0", op, enc, {}, [TensorMeta.of(e) for e in expected], multi=True)
    graph_inputs = [(f"x{i}", TensorMeta.of(t)) for i, t in enumerate(inputs)]
    return Graph(inputs=graph_inputs, nodes=[node], outputs=node.output_refs), inputs


@pytest.mark.parametrize("mask", [[False, True, True], [True, False, True], [False, True, False], [False, False, True]],
                         ids=str)
def test_output_mask_gives_only_the_wanted_gradients(vulkan, mask):
    from tapml.judging.compare import compare_tensor
    torch.manual_seed(1)
    x, w = torch.randn(2, 4, 7, 6), torch.randn(6, 2, 3, 2)
    dy = torch.randn_like(aten.convolution(x, w, None, [2, 1], [1, 0], [1, 2], False, [0, 0], 2))
    conv_args = [dy, x, w, [6], [2, 1], [1, 0], [1, 2], False, [0, 0], 2, mask]
    h = torch.randn(3, 5, 8)
    _, mean, rstd = aten.native_layer_norm(h, [8], torch.randn(8), None, 1e-5)
    ln_args = [torch.randn(3, 5, 8), h, [8], mean, rstd, torch.randn(8), torch.randn(8), mask]
    for op, args in (("aten.convolution_backward.default", conv_args),
                     ("aten.native_layer_norm_backward.default", ln_args)):
        # torch returns None for what is not wanted (its CPU convolution computes grad_weight with grad_bias)
        expected = [t for t in getattr(aten, op.split(".")[1]).default(*args) if t is not None]
        assert sum(mask) <= len(expected) <= 3
        graph, inputs = _masked_graph(op, args, expected)
        out = vulkan.run(vulkan.compile(graph), inputs)
        assert [o.shape for o in out] == [e.shape for e in expected]
        for o, e in zip(out, expected):
            assert compare_tensor(o, e).passed, (op, mask)


def test_a_node_whose_outputs_fit_no_output_mask_is_refused_with_the_reason():
    from tapml.graph import Node, TensorMeta
    from tapml.platforms.wgsl import supports
    node = Node("n0", "aten.native_layer_norm_backward.default",
                [{"ref": "a"}, {"ref": "b"}, [8], {"ref": "c"}, {"ref": "d"}, None, None, [True, False, False]], {},
                [TensorMeta((3, 8), "float32"), TensorMeta((8,), "float32")], multi=True)
    reason = supports(node, {})
    assert reason is not None and "output_mask wants 1" in reason


class FirstLayerStep(nn.Module):
    """A loss whose first convolution's input needs no gradient (output_mask [False, True, True])
    and whose second has no bias ([True, True, False])."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 4, 3, padding=1, bias=False)
        self.ln, self.fc = nn.LayerNorm(4, elementwise_affine=False), nn.Linear(4, 5)

    def forward(self, img, labels):
        h = nn.functional.max_pool2d(torch.relu(self.c1(img)), 2)
        h = self.ln(self.c2(h).mean((2, 3)))
        return (nn.functional.cross_entropy(self.fc(h), labels),)


@pytest.mark.parametrize("backend", ["vulkan", "gl"])
def test_joint_training_graph_from_export_carves_and_migrates(backend, tmp_path):
    """torch's own training export (forward and backward in one program) gives backward ops
    whose unwanted gradients are None; they carve with the wanted ones and pass on the target."""
    from torch.export.experimental import _export_forward_backward
    from tapml.carving import CarveStore, carve
    from tapml.driving.migrate import Migration, exit_code
    from tapml.platforms.wgpu_native import available_backends, shared_platform
    if backend not in available_backends():
        pytest.skip(f"no {backend} adapter here")
    torch.manual_seed(0)
    joint = _export_forward_backward(torch.export.export(FirstLayerStep(), (torch.randn(2, 3, 10, 10),
                                                                            torch.tensor([1, 4]))))
    masks = [n.args[-1] for n in joint.graph.nodes if n.target is aten.convolution_backward.default]
    assert [False, True, True] in masks and [True, True, False] in masks, masks
    torch.export.save(joint, tmp_path / "step.pt2")
    carve(str(tmp_path / "step.pt2"), tmp_path / "store")
    store = CarveStore(tmp_path / "store")
    conv = [c for c in store.cases if c["op"] == "aten.convolution_backward.default"]
    # each lists the gradients its mask wants, and its mask says so
    assert sorted(len(c["output_meta"]) for c in conv) == [2, 2], [c["output_meta"] for c in conv]
    assert sorted(c["args"][-1] for c in conv) == [[False, True, True], [True, True, False]]
    state = Migration(store, shared_platform(backend), f"wgpu:{backend}", tmp_path / "s.json").run()
    assert state["summary"]["pass"] == len(store.cases), [(c["op"], c["message"][:120]) for c in state["cases"]
                                                           if c["status"] != "pass"]
    assert state["placement"]["ops_on_target"] == state["placement"]["ops_total"], state["placement"]["ops_total"]
    assert state["end_to_end"]["status"] == "pass" and exit_code(state) == 0
