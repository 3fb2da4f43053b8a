"""3-D and adaptive pooling, pairwise distances, embedding bags, batch norm from batch statistics
(without running stats, and a CNN left in train() mode, also as a joint training graph) and
nonzero in model code: each family's small model is carved with ``tapml carve path.py:factory``
and every case replayed on lavapipe Vulkan (device tier). The FFTs are lowered for complex64 held as
float32 pairs (tests/test_complex.py runs them); complex128 stays refused by design, which needs no
device.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from tapml.cli import app
from tapml.graph import Node, TensorMeta
from support import vulkan_or_skip

FACTORIES = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn


    class VideoPooling(nn.Module):
        """A video stem: 3-D convolution, 3-D pooling both ways, adaptive heads (3-D and 2-D)."""

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv3d(3, 4, 3, padding=1)

        def forward(self, clip):
            x = self.conv(clip)
            avg = F.avg_pool3d(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
            peak, where = F.max_pool3d(x, (2, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), dilation=(2, 1, 1),
                                       return_indices=True)
            head = F.adaptive_avg_pool3d(x, (2, 3, 3))
            spot, spot_at = F.adaptive_max_pool3d(x, (3, 2, 3), return_indices=True)
            frame, frame_at = F.adaptive_max_pool2d(x[:, :, 0], (3, 5), return_indices=True)
            return avg, peak, where, head, spot, spot_at, frame, frame_at


    def pooling():
        torch.manual_seed(0)
        return VideoPooling().eval(), (torch.randn(2, 3, 6, 9, 10),)


    class Prototypes(nn.Module):
        """A prototype classifier: embeddings against 30 class prototypes (torch's matrix-product
        path for p = 2), their manhattan distances, and the pairwise distances in the batch."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(12, 8)
            self.prototypes = nn.Parameter(torch.randn(30, 8))

        def forward(self, x):
            e = self.embed(x)
            return (torch.cdist(e, self.prototypes), torch.cdist(e, self.prototypes, p=1.0),
                    torch.cdist(e, self.prototypes[:5], p=float("inf"), compute_mode="donot_use_mm_for_euclid_dist"),
                    F.pdist(e), F.pdist(e, p=3.0))


    def distances():
        torch.manual_seed(0)
        return Prototypes().eval(), (torch.randn(7, 12),)


    class Bags(nn.Module):
        """Bag-of-words text features: mean, max and weighted sums over bags of token ids."""

        def __init__(self):
            super().__init__()
            self.mean = nn.EmbeddingBag(50, 6, mode="mean", padding_idx=0)
            self.max = nn.EmbeddingBag(50, 6, mode="max")
            self.sum = nn.EmbeddingBag(50, 6, mode="sum", include_last_offset=True)

        def forward(self, tokens, offsets, weights):
            return (self.mean(tokens, offsets), self.max(tokens, offsets),
                    self.sum(tokens, torch.cat([offsets, offsets.new_tensor([tokens.numel()])]), weights))


    def bags():
        torch.manual_seed(0)
        tokens = torch.randint(0, 50, (20,))
        tokens[3] = 0
        return Bags().eval(), (tokens, torch.tensor([0, 4, 4, 11, 15]), torch.rand(20))


    class BatchStats(nn.Module):
        """Batch norm without running statistics (normalized by the batch's own, also in eval)."""

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 5, 3)
            self.norm = nn.BatchNorm2d(5, track_running_stats=False)
            self.norm1d = nn.BatchNorm1d(5, affine=False, track_running_stats=False)

        def forward(self, x):
            y = self.norm(self.conv(x))
            return y, self.norm1d(y.mean((2, 3)))


    def batch_stats():
        torch.manual_seed(0)
        return BatchStats().eval(), (torch.randn(4, 3, 7, 6),)


    class TrainModeCNN(nn.Module):
        """A CNN left in train() mode (no .eval()): 2-d batch norm after a convolution, 1-d batch
        norm with another momentum on the flattened head; its export holds
        _native_batch_norm_legit_functional (batch statistics and updated running ones)."""

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 6, 3, padding=1)
            self.norm = nn.BatchNorm2d(6)
            self.conv2 = nn.Conv2d(6, 4, 3, stride=2)
            self.head_norm = nn.BatchNorm1d(4 * 3 * 3, momentum=0.3)

        def forward(self, x):
            h = torch.relu(self.norm(self.conv(x)))
            return self.head_norm(self.conv2(h).flatten(1))


    def train_mode_cnn():
        torch.manual_seed(0)
        return TrainModeCNN().train(), (torch.randn(4, 3, 8, 8),)


    class TrainModeLoss(nn.Module):
        """The same CNN under a scalar loss, for a joint forward-backward export."""

        def __init__(self):
            super().__init__()
            self.net = TrainModeCNN()

        def forward(self, x, target):
            return (F.mse_loss(self.net(x), target),)


    def train_mode_loss():
        torch.manual_seed(0)
        return TrainModeLoss().train(), (torch.randn(4, 3, 8, 8), torch.randn(4, 36))


    class Detections(nn.Module):
        """Where a score map passes a threshold: the coordinates of the kept cells."""

        def forward(self, scores):
            return torch.nonzero(scores > 0.5), torch.nonzero(scores.argmax(-1))


    def detections():
        torch.manual_seed(0)
        return Detections().eval(), (torch.randn(3, 9, 11),)
''')

#: factory -> the ops its export must hold (each passing on the device); a tuple: one of them
FAMILIES = {
    "pooling": ["aten.avg_pool3d.default", "aten.max_pool3d_with_indices.default", "aten._adaptive_avg_pool3d.default",
                "aten.adaptive_max_pool3d.default", "aten.adaptive_max_pool2d.default"],
    "distances": ["aten._cdist_forward.default", "aten._pdist_forward.default"],
    "bags": [("aten._embedding_bag.default", "aten._embedding_bag_forward_only.default")],
    "batch_stats": ["aten._native_batch_norm_legit.no_stats"],
    "detections": ["aten.nonzero.default"],
}

runner = CliRunner()


def tapml(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "models.py"
    path.write_text(FACTORIES)
    return path




@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_carves_and_replays_on_vulkan(family, factories, tmp_path):
    vulkan_or_skip()
    store = tmp_path / "store"
    r = tapml("carve", f"{factories}:{family}", "-o", store)
    assert r.exit_code == 0, r.output
    verdicts = tmp_path / "verdicts.json"
    r = tapml("replay", store, "--target", "wgpu:vulkan", "--json", verdicts)
    doc = json.loads(verdicts.read_text())
    failing = [(c["op"], c["status"], c["message"][:200]) for c in doc["cases"] if c["status"] != "pass"]
    assert r.exit_code == 0 and not failing, failing or r.output
    ops = {c["op"] for c in doc["cases"]}
    for want in FAMILIES[family]:
        names = want if isinstance(want, tuple) else (want,)
        assert ops & set(names), f"{family}: no case of {' or '.join(names)} in {sorted(ops)}"


def _migrated_wholly(r, state_path):
    """The migrate command's state: every case passes and every op is placed on the target."""
    state = json.loads(state_path.read_text())
    failing = [(c["op"], c["status"], c["message"][:200]) for c in state["cases"] if c["status"] != "pass"]
    assert r.exit_code == 0 and not failing, failing or r.output
    assert state["placement"]["ops_on_target"] == state["placement"]["ops_total"] > 0, state["placement"]
    assert state["end_to_end"]["status"] == "pass", state["end_to_end"]
    return state


def _train_mode_pt2(factories, tmp_path, factory: str, joint: bool = False):
    """The factory's model exported as it is, in train() mode (a ``file.py:factory`` spec would
    put it in eval mode), optionally as torch's joint forward-backward graph, saved as a .pt2."""
    import runpy
    from torch.export.experimental import _export_forward_backward
    model, inputs = runpy.run_path(str(factories))[factory]()
    program = torch.export.export(model, inputs)
    if joint:
        program = _export_forward_backward(program)
    torch.export.save(program, tmp_path / "model.pt2")
    return tmp_path / "model.pt2"


def _migrate_wholly(program, backend: str, tmp_path) -> dict:
    """``tapml carve`` then ``tapml migrate --target wgpu:BACKEND``: exit 0, every case passes,
    every op is placed on the target and the whole model passes; returns the state."""
    store = tmp_path / "store"
    r = tapml("carve", program, "-o", store)
    assert r.exit_code == 0, r.output
    r = tapml("migrate", store, "--target", f"wgpu:{backend}", "--state", tmp_path / "s.json", "-q")
    state = json.loads((tmp_path / "s.json").read_text())
    failing = [(c["op"], c["status"], c["message"][:200]) for c in state["cases"] if c["status"] != "pass"]
    assert r.exit_code == 0 and not failing, failing or r.output
    assert state["placement"]["ops_on_target"] == state["placement"]["ops_total"] > 0, state["placement"]
    assert state["end_to_end"]["status"] == "pass", state["end_to_end"]
    return state


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
def test_cnn_left_in_train_mode_migrates_wholly(backend, factories, tmp_path):
    """A CNN exported without .eval() normalizes by its batch's statistics and updates its running
    ones (_native_batch_norm_legit_functional): carved and migrated, every op passes on the target."""
    from tapml.platforms.wgpu_native import available_backends
    if backend not in available_backends():
        pytest.skip(f"no wgpu {backend} adapter here (lavapipe and llvmpipe come with mesa)")
    state = _migrate_wholly(_train_mode_pt2(factories, tmp_path, "train_mode_cnn"), backend, tmp_path)
    norms = [c for c in state["cases"] if c["op"] == "aten._native_batch_norm_legit_functional.default"]
    assert len(norms) == 2, sorted(c["op"] for c in state["cases"])


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_joint_training_graph_with_batch_norm_migrates_wholly(factories, tmp_path):
    """torch's joint forward-backward export of the train-mode CNN under a loss: carved and
    migrated on Vulkan, every op (batch norm in training mode included) on the target."""
    vulkan_or_skip()
    state = _migrate_wholly(_train_mode_pt2(factories, tmp_path, "train_mode_loss", joint=True), "vulkan", tmp_path)
    assert {"aten._native_batch_norm_legit_functional.default", "aten.convolution_backward.default"} <= \
        {c["op"] for c in state["cases"]}


def test_fft_is_lowered_for_complex64_and_refused_for_complex128():
    """The FFTs take complex64 (float32 pairs on the device); complex128 is refused by design, with
    the reason, not 'no lowering'."""
    from tapml.platforms.wgsl import supports
    caps = {"features": [], "limits": {}}
    for real, cplx in ((torch.randn(8), None), (torch.randn(8, dtype=torch.float64), None)):
        spec = torch.fft.rfft(real)
        r2c = Node("f", "aten._fft_r2c.default", [{"ref": "x"}, [0], 0, True], {}, [TensorMeta.of(spec)])
        c2r = Node("g", "aten._fft_c2r.default", [{"ref": "s"}, [0], 0, 8], {}, [TensorMeta.of(real)])
        c2c = Node("h", "aten._fft_c2c.default", [{"ref": "s"}, [0], 0, True], {}, [TensorMeta.of(spec)])
        for node, ins in ((r2c, [TensorMeta.of(real)]), (c2r, [TensorMeta.of(spec)]), (c2c, [TensorMeta.of(spec)])):
            reason = supports(node, caps, ins)
            if real.dtype == torch.float32:
                assert reason is None, reason
            else:
                assert reason and ("64-bit floats" in reason or "complex128" in reason), reason
                assert "no WGSL lowering" not in reason


def test_variants_torch_cannot_run_are_refused_with_the_reason():
    """Batch norm without statistics and without training has nothing to normalize with (torch
    itself crashes on it); a negative p is no distance. Verdicts, not crashes."""
    from tapml.platforms.wgsl import supports
    from tapml.platforms.wgsl.registry import case_graph
    caps = {"features": [], "limits": {}}
    graph, _ = case_graph("aten._native_batch_norm_legit.no_stats", [torch.randn(4, 3), None, None, True, 0.1, 1e-5])
    node = graph.nodes[0]
    assert supports(node, caps, [graph.meta["x0"]]) is None
    node.args[3] = False
    assert "without training" in supports(node, caps, [graph.meta["x0"]])
    # torch itself crashes (segfaults) on native_batch_norm without training and without running stats
    graph, _ = case_graph("aten.native_batch_norm.default", [torch.randn(4, 3), None, None, None, None, True, 0.1, 1e-5])
    node = graph.nodes[0]
    assert supports(node, caps, [graph.meta["x0"]]) is None
    node.args[5] = False
    assert "without running statistics" in supports(node, caps, [graph.meta["x0"]])
    graph, _ = case_graph("aten._cdist_forward.default", [torch.randn(3, 2), torch.randn(4, 2), 1.0, None])
    node = graph.nodes[0]
    assert supports(node, caps, [graph.meta["x0"], graph.meta["x1"]]) is None
    node.args[2] = -1.0
    assert "negative p" in supports(node, caps, [graph.meta["x0"], graph.meta["x1"]])


def test_nonzero_takes_its_row_count_from_the_recorded_shape():
    """nonzero's output size depends on the data: the lowering sizes its output from the node's
    recorded shape and compiles a prefix count, no host fallback."""
    from tapml.platforms.wgsl import compile_graph
    from tapml.platforms.wgsl.registry import case_graph
    x = torch.tensor([[0.0, 1.5, -0.0], [float("nan"), 0.0, 2.0]])
    graph, _ = case_graph("aten.nonzero.default", [x])
    assert graph.nodes[0].outputs[0].shape == (3, 2) and graph.nodes[0].outputs[0].dtype == "int64"
    program = compile_graph(graph, {"features": [], "limits": {}})
    assert [k.name.rsplit("_", 1)[0] for k in program.kernels] == ["mask_count", "mask_starts", "mask_positions",
                                                                    "nonzero"]


LAYERS_WITH_INTERNALS = textwrap.dedent('''
    import torch


    class Pairwise(torch.nn.Module):
        """nn.Bilinear exports as aten._trilinear; torch.linalg.svd as aten._linalg_svd."""

        def __init__(self):
            super().__init__()
            self.pair = torch.nn.Bilinear(6, 5, 4)

        def forward(self, x, y):
            return torch.tanh(self.pair(x, y))


    class Spectrum(torch.nn.Module):
        def forward(self, m):
            return torch.linalg.svdvals(m).sum(-1) + m.mean()


    def pairwise():
        torch.manual_seed(0)
        return Pairwise(), (torch.randn(8, 6), torch.randn(8, 5))


    def spectrum():
        return Spectrum(), (torch.randn(3, 5, 4),)
''')


@pytest.mark.device
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
def test_bilinear_layer_migrates_wholly(tmp_path, backend):
    from tapml.platforms.wgpu_native import available_backends
    if backend not in available_backends():
        pytest.skip(f"no {backend} adapter here")
    (tmp_path / "m.py").write_text(LAYERS_WITH_INTERNALS)
    r = tapml("migrate", f"{tmp_path / 'm.py'}:pairwise", "--target", f"wgpu:{backend}", "--state", tmp_path / "s.json")
    assert r.exit_code == 0, r.output
    state = json.loads((tmp_path / "s.json").read_text())
    assert "aten._trilinear.default" in {c["op"] for c in state["cases"]}
    assert state["placement"]["ops_on_target"] == state["placement"]["ops_total"]


def test_an_exported_torch_internal_without_a_lowering_carves_and_is_unsupported(tmp_path):
    """torch.linalg.svdvals exports as aten._linalg_svd: it carves and replays on the
    reference; on a target without its lowering it is an unsupported verdict, not a refusal."""
    (tmp_path / "m.py").write_text(LAYERS_WITH_INTERNALS)
    r = tapml("carve", f"{tmp_path / 'm.py'}:spectrum", "-o", tmp_path / "store")
    assert r.exit_code == 0, r.output
    r = tapml("replay", tmp_path / "store", "--target", "reference", "--json", tmp_path / "v.json")
    assert r.exit_code == 0, r.output
    ops = {c["op"] for c in json.loads((tmp_path / "v.json").read_text())["cases"]}
    assert "aten._linalg_svd.default" in ops
    from tapml.carving import CarveStore
    from tapml.platforms.wgsl import supports
    svd = next(n for n in CarveStore(tmp_path / "store").graph.nodes if n.op == "aten._linalg_svd.default")
    assert "no WGSL lowering for aten._linalg_svd.default" in supports(svd, {})
