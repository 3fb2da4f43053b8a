"""Random ops: judged on shape, dtype and distribution, never on values.

The WGSL lowerings (platforms/wgsl/random.py, a Philox generator keyed per node) draw 64k
elements on lavapipe Vulkan and llvmpipe GL, judged by :func:`tapml.judging.compare.compare_distribution`;
generators that are wrong in the ways real bugs are (constant, shifted, too narrow, a mask that
disagrees with the output) are mismatches, so the check is not vacuous; and a small model with
nn.Dropout in training mode and a ``torch.rand_like(x) < 0.5`` mask is carved, replayed and
migrated on wgpu:vulkan with pass verdicts that say how they were judged, as are a sampler
(torch.multinomial on softmax probabilities, the Gumbel trick) and a noise-injecting model
(torch.normal, normal_, uniform_).
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from tapml.judging.compare import RANDOM_NOTE, RANDOM_OPS, UNINITIALIZED_NOTE, compare_distribution, is_random_op
from tapml.graph import Graph, Node, TensorMeta, run_node
from tapml.platforms.wgsl import load_lowerings
from tapml.platforms.wgsl.registry import case_graph, supports_node

N = [256, 256]  # 65536 draws: a KS bound of 0.01


def _backends():
    try:
        from tapml.platforms.wgpu_native import available_backends
        return available_backends()
    except Exception:  # noqa: BLE001 - no wgpu at all: the device tests say why they skip
        return ()


BACKENDS = _backends()
REGISTRY = load_lowerings()


def _platform(backend):
    from tapml.platforms.wgpu_native import shared_platform
    if backend not in BACKENDS:
        pytest.skip(f"no {backend} adapter here (have: {', '.join(BACKENDS) or 'none'})")
    return shared_platform(backend)


def _x(dtype=torch.float32):
    torch.manual_seed(0)
    return (torch.randn(*N) + 0.1).to(dtype)


def _std(dtype=torch.float32):
    torch.manual_seed(1)
    return (torch.rand(*N) * 2 + 0.05).to(dtype)


def _weights(rows, cats, zero_every=0):
    """Category weights (torch takes them unnormalized), every ``zero_every``-th category 0."""
    torch.manual_seed(2)
    w = torch.rand(rows, cats) ** 2 + 0.01
    if zero_every:
        w[:, ::zero_every] = 0.0
    return w


#: (op, args, kwargs) drawn on the device, every claimed output dtype of each op at least once
DRAWS = [
    ("aten.rand.default", lambda: ([N], {})),
    ("aten.rand.default", lambda: ([N], {"dtype": torch.float16})),
    ("aten.rand.default", lambda: ([N], {"dtype": torch.bfloat16})),
    ("aten.rand_like.default", lambda: ([_x()], {})),
    ("aten.randn.default", lambda: ([N], {})),
    ("aten.randn.default", lambda: ([N], {"dtype": torch.float16})),
    ("aten.randn_like.default", lambda: ([_x(torch.bfloat16)], {})),
    ("aten.bernoulli.p", lambda: ([_x(), 0.3], {})),
    ("aten.bernoulli.p", lambda: ([_x(torch.float16), 0.7], {})),
    ("aten.bernoulli.default", lambda: ([torch.rand(*N)], {})),
    ("aten.native_dropout.default", lambda: ([_x(), 0.2, True], {})),
    ("aten.native_dropout.default", lambda: ([_x(torch.float16), 0.5, None], {})),
    ("aten.native_dropout.default", lambda: ([_x(torch.bfloat16), 0.1, True], {})),
    ("aten.native_dropout.default", lambda: ([_x(), 0.2, False], {})),
    ("aten.randint.default", lambda: ([10, N], {})),
    ("aten.randint.low", lambda: ([-2**31, 2**31, N], {})),
    ("aten.randint.low", lambda: ([-3, 1000, N], {"dtype": torch.int32})),
    ("aten.randint_like.low_dtype", lambda: ([_x(), 0, 3], {})),
    ("aten.randint_like.default", lambda: ([_x(torch.float16), 100], {})),
    ("aten.randperm.default", lambda: ([65536], {})),
    ("aten.normal.Tensor_float", lambda: ([_x(), 0.5], {})),
    ("aten.normal.float_Tensor", lambda: ([2.0, _std()], {})),
    ("aten.normal.Tensor_Tensor", lambda: ([_x(torch.float16), _std(torch.float16)], {})),
    ("aten.normal.Tensor_Tensor", lambda: ([_x()[:, :1], _std()[0]], {})),  # broadcast
    ("aten.normal.float_float", lambda: ([1.0, 3.0, N], {"dtype": torch.bfloat16})),
    ("aten.normal_functional.default", lambda: ([_x(), -1.0, 0.25], {})),
    ("aten.uniform.default", lambda: ([_x(), -2.0, 5.0], {})),
    ("aten.uniform.default", lambda: ([_x(torch.bfloat16), 0.0, 1.0], {})),
    ("aten.exponential.default", lambda: ([_x(), 2.5], {})),
    ("aten.exponential.default", lambda: ([_x(torch.float16)], {})),
    ("aten.bernoulli.Tensor", lambda: ([_x(), torch.rand(*N)], {})),
    ("aten.bernoulli.Tensor", lambda: ([_x().to(torch.int32), torch.rand(N[-1]).half()], {})),
    ("aten.multinomial.default", lambda: ([_weights(256, 50), 256, True], {})),  # 65536 draws
    ("aten.multinomial.default", lambda: ([_weights(1024, 64, zero_every=4), 48], {})),  # 49152, no repeats
    ("aten.multinomial.default", lambda: ([torch.softmax(torch.randn(2, 3000), -1).bfloat16(), 200], {})),
    ("aten.cauchy.default", lambda: ([_x(), 1.5, 0.5], {})),
    ("aten.cauchy.default", lambda: ([_x(torch.float16)], {})),
    ("aten.cauchy.default", lambda: ([_x(torch.bfloat16), -2.0, 3.0], {})),
    ("aten.log_normal.default", lambda: ([_x(), 0.5, 0.75], {})),
    ("aten.log_normal.default", lambda: ([_x(torch.float16), -1.0, 0.5], {})),
    ("aten.log_normal.default", lambda: ([_x(torch.bfloat16)], {})),
    ("aten.geometric.default", lambda: ([_x(), 0.3], {})),
    ("aten.geometric.default", lambda: ([_x(), 0.002], {})),
    ("aten.geometric.default", lambda: ([_x(torch.float16), 0.05], {})),
    ("aten.geometric.default", lambda: ([_x(torch.bfloat16), 0.6], {})),
    ("aten.geometric.default", lambda: ([_x().to(torch.int32), 0.1], {})),
    ("aten.geometric.default", lambda: ([_x().to(torch.uint8), 0.5], {})),
    ("aten.rrelu_with_noise_functional.default", lambda: ([_x(), torch.zeros(*N), 0.1, 0.3, True], {})),
    ("aten.rrelu_with_noise_functional.default", lambda: ([_x(torch.bfloat16), torch.zeros(*N).bfloat16(), -1.0, 2.0,
                                                          True], {})),
    ("aten.rrelu_with_noise_functional.default", lambda: ([_x(), _std(), 0.2, 0.4, False], {})),
]


def _draw(platform, op, args, kwargs):
    graph, inputs = case_graph(op, args, kwargs)
    out = platform.run(platform.compile(graph), inputs)
    ref = run_node(graph.nodes[0], dict(zip([r for r, _ in graph.inputs], inputs)).__getitem__)
    return graph, inputs, out, ref


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
@pytest.mark.parametrize("op,make", DRAWS, ids=[f"{op.split('.', 1)[1]}-{i}" for i, (op, _) in enumerate(DRAWS)])
def test_lowering_draws_its_distribution(backend, op, make):
    platform = _platform(backend)
    args, kwargs = make()
    _, _, out, ref = _draw(platform, op, args, kwargs)
    result = compare_distribution(op, out, ref, args, kwargs)
    assert result.passed, result.message
    assert result.message.startswith(RANDOM_NOTE) and "n=" in result.message
    assert compare_distribution(op, ref, ref, args, kwargs).passed  # torch's own draws: the bounds are fair


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
@pytest.mark.parametrize("op", sorted(RANDOM_OPS))
def test_registry_samples_pass_by_distribution(backend, op):
    """Every sample of the registry entry (edge values, p of 0 and 1, every dtype), in float32 and
    cast to float16 and bfloat16, judged as replay judges it."""
    from support import LOW, low_precision_case
    from tapml.graph import decode_arg
    from tapml.platforms.wgsl.registry import sample_cases
    platform = _platform(backend)
    torch.manual_seed(0)
    ran = 0
    for graph, inputs in sample_cases(op):
        variants = [(graph, inputs)] + [case[:2] for case in (low_precision_case(graph, inputs, d) for d in LOW)
                                        if case is not None and any(t.dtype == torch.float32 for t in inputs)]
        for g, ins in variants:
            env = dict(zip([r for r, _ in g.inputs], ins))
            node = g.nodes[0]
            args = decode_arg(node.args, env.__getitem__)
            kwargs = {k: decode_arg(v, env.__getitem__) for k, v in node.kwargs.items()}
            out = platform.run(platform.compile(g), ins)
            result = compare_distribution(op, out, run_node(node, env.__getitem__), args, kwargs)
            assert result.passed, f"{op} {[(t.dtype, tuple(t.shape)) for t in ins]} {node.args}: {result.message}"
            ran += 1
    assert ran >= 4


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.skipif("vulkan" not in BACKENDS, reason="no wgpu Vulkan adapter (install mesa-vulkan-drivers)")
def test_draws_are_a_function_of_node_and_index():
    """The same program draws the same values every run, a buffer bound through windows draws
    the same values as a whole one, and two nodes draw independent values."""
    from tapml.platforms.wgpu_native import WgpuPlatform
    platform = WgpuPlatform("vulkan")  # its own device: forced limits stay out of the shared platform
    try:
        for op, args, kwargs in [("aten.rand.default", [[64, 64]], {}), ("aten.randn.default", [[64, 64]], {}),
                                 ("aten.native_dropout.default", [_x()[:64], 0.3, True], {}),
                                 ("aten.randperm.default", [5000], {})]:
            graph, inputs = case_graph(op, args, kwargs)
            program = platform.compile(graph)
            first, again = platform.run(program, inputs), platform.run(program, inputs)
            assert all(torch.equal(a, b) for a, b in zip(first, again)), op
            largest = max(b.size for b in program.buffers)
            platform.force_limits({"max-storage-buffer-binding-size": largest // 2 // 256 * 256})
            try:
                split = platform.compile(graph)
                assert any(len(b) == 4 for k in split.kernels for b in k.bindings), f"{op}: nothing was split"
                windows = platform.run(split, inputs)
            finally:
                platform.__dict__.pop("forced_limits", None)
            assert all(torch.equal(a, b) for a, b in zip(first, windows)), f"{op}: split draws differ"
    finally:
        platform.close()
    vulkan = _platform("vulkan")
    meta = TensorMeta((4096,), "float32")
    graph = Graph(inputs=[], nodes=[Node("a", "aten.rand.default", [[4096]], {}, [meta]),
                                    Node("b", "aten.rand.default", [[4096]], {}, [meta])], outputs=["a", "b"])
    a, b = vulkan.run(vulkan.compile(graph), [])
    r = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    assert not torch.equal(a, b) and abs(r) < 6 / math.sqrt(4096), r


def _philox(counter: int, key0: int, key1: int) -> list[int]:
    """Philox-4x32-10 of the counter (counter, 0, 0, 0), after Random123 (Salmon et al., SC11)."""
    c, mask = [counter, 0, 0, 0], 0xFFFFFFFF
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ key0) & mask, p1 & mask, ((p0 >> 32) ^ c[3] ^ key1) & mask, p0 & mask]
        key0, key1 = (key0 + 0x9E3779B9) & mask, (key1 + 0xBB67AE85) & mask
    return c


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
def test_the_generator_is_philox(backend):
    """The device's generator is Philox-4x32-10 bit for bit (its known answer first): randint over
    all of i32 is ``low + r`` of the first word, so it shows the raw bits."""
    from tapml.platforms.wgsl.random import node_key
    assert _philox(0, 0, 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]  # Random123's known answer
    platform = _platform(backend)
    graph, inputs = case_graph("aten.randint.low", [-2**31, 2**31, [2000]])
    out = platform.run(platform.compile(graph), inputs)[0]
    key = node_key(graph.nodes[0])
    bits = torch.tensor([_philox(i, *key)[0] for i in range(2000)], dtype=torch.int64)
    assert torch.equal(out, bits - 2**31)  # low = -2**31: u32(low) + r wraps to r - 2**31


# --- the check is not vacuous --------------------------------------------------------------

def _bad_cases():
    torch.manual_seed(1)
    n = 65536
    x = torch.randn(n)
    mask = torch.rand(n) >= 0.2
    half = torch.rand(n) >= 0.5
    ident = torch.arange(n)
    uniform = torch.rand(n)
    weights = torch.rand(500, 64) ** 3
    weights[:, 0] = 0.0
    weightless_pick = torch.multinomial(weights, 20, replacement=True)
    weightless_pick[7, 3] = 0
    cauchy = torch.tan(math.pi * (uniform.double() - 0.5)).float()
    geometric = torch.ceil(torch.log(uniform.clamp_min(1e-7)) / math.log1p(-0.3)).clamp_min(1)
    neg = x <= 0
    slope = 0.1 + 0.2 * uniform
    noise = torch.where(neg, slope, torch.ones(n))
    return [
        ("normal as cauchy", "aten.cauchy.default", [x, 0.0, 1.0], torch.randn(n)),
        ("cauchy off median", "aten.cauchy.default", [x, 1.0, 1.0], cauchy),
        ("cauchy too wide", "aten.cauchy.default", [x, 0.0, 1.0], 1.3 * cauchy),
        ("cauchy NaN", "aten.cauchy.default", [x, 0.0, 1.0], torch.where(half, math.nan, cauchy)),
        ("normal as log_normal", "aten.log_normal.default", [x, 0.0, 1.0], torch.randn(n)),
        ("log_normal ignores std", "aten.log_normal.default", [x, 0.0, 2.0], torch.exp(torch.randn(n))),
        ("log_normal ignores mean", "aten.log_normal.default", [x, 0.5, 1.0], torch.exp(torch.randn(n))),
        ("exponential as geometric", "aten.geometric.default", [x, 0.3], -torch.log1p(-uniform) / 0.3),
        ("geometric from 0", "aten.geometric.default", [x, 0.3], geometric - 1),
        ("geometric wrong p", "aten.geometric.default", [x, 0.3],
         torch.ceil(torch.log(uniform.clamp_min(1e-7)) / math.log1p(-0.35)).clamp_min(1)),
        ("geometric rounded", "aten.geometric.default", [x, 0.3],
         torch.round(torch.log(uniform.clamp_min(1e-7)) / math.log1p(-0.3)).clamp_min(1)),
        ("rrelu scales positives", "aten.rrelu_with_noise_functional.default", [x, torch.zeros(n), 0.1, 0.3, True],
         (x * slope, slope)),
        ("rrelu noise disagrees", "aten.rrelu_with_noise_functional.default", [x, torch.zeros(n), 0.1, 0.3, True],
         (x * torch.where(neg, 0.2, 1.0), noise)),
        ("rrelu slope past upper", "aten.rrelu_with_noise_functional.default", [x, torch.zeros(n), 0.1, 0.3, True],
         (x * torch.where(neg, slope * 1.2, 1.0), torch.where(neg, slope * 1.2, 1.0))),
        ("rrelu constant slope", "aten.rrelu_with_noise_functional.default", [x, torch.zeros(n), 0.1, 0.3, True],
         (x * torch.where(neg, 0.2, 1.0), torch.where(neg, 0.2, 1.0))),
        ("rrelu slopes piled low", "aten.rrelu_with_noise_functional.default", [x, torch.zeros(n), 0.1, 0.3, True],
         (x * torch.where(neg, 0.1 + 0.2 * uniform ** 2, 1.0), torch.where(neg, 0.1 + 0.2 * uniform ** 2, 1.0))),
        ("rrelu eval draws", "aten.rrelu_with_noise_functional.default", [x, torch.zeros(n), 0.1, 0.3, False],
         (x * noise, noise)),
        ("zeros", "aten.rand.default", [[n]], torch.zeros(n)),
        ("a constant", "aten.rand.default", [[n]], torch.full((n,), 0.5)),
        ("too narrow", "aten.rand.default", [[n]], uniform * 0.9),
        ("past 1", "aten.rand.default", [[n]], uniform + 0.5),
        ("uniform as normal", "aten.randn.default", [[n]], uniform * 3.4 - 1.7),
        ("too wide", "aten.randn.default", [[n]], torch.randn(n) * 1.2),
        ("shifted", "aten.randn.default", [[n]], torch.randn(n) + 0.1),
        ("a NaN", "aten.randn.default", [[n]], torch.cat([torch.randn(n - 1), torch.tensor([math.nan])])),
        ("all ones", "aten.bernoulli.p", [x, 0.3], torch.ones(n)),
        ("p=0 drawn 1", "aten.bernoulli.default", [torch.zeros(n)], (torch.rand(n) < 0.001).float()),
        ("not 0/1", "aten.bernoulli.p", [x, 0.5], torch.rand(n)),
        ("output ignores mask", "aten.native_dropout.default", [x, 0.2, True], (x / 0.8, mask)),
        ("half dropped", "aten.native_dropout.default", [x, 0.2, True], (x * half / 0.8, half)),
        ("unscaled", "aten.native_dropout.default", [x, 0.2, True], (x * mask, mask)),
        ("eval drops", "aten.native_dropout.default", [x, 0.2, False], (x * mask, mask)),
        ("even only", "aten.randint.default", [10, [n]], torch.randint(0, 5, (n,)) * 2),
        ("past high", "aten.randint.default", [10, [n]], torch.randint(1, 11, (n,))),
        ("narrow wide range", "aten.randint.low", [-2**31, 2**31, [n]], torch.randint(0, 2**20, (n,))),
        ("identity", "aten.randperm.default", [n], ident),
        ("reversed", "aten.randperm.default", [n], ident.flip(0)),
        ("a repeat", "aten.randperm.default", [n], torch.cat([torch.randperm(n - 1), torch.tensor([0])])),
        ("std ignored", "aten.normal.Tensor_float", [x, 2.0], x + torch.randn(n)),
        ("mean ignored", "aten.normal.float_Tensor", [3.0, x.abs() + 0.1], torch.randn(n) * (x.abs() + 0.1)),
        ("std 0 not the mean", "aten.normal.Tensor_float", [x, 0.0], x + 1e-3),
        ("NaN mean drawn finite", "aten.normal.Tensor_Tensor", [torch.full((n,), math.nan), torch.ones(n)],
         torch.randn(n)),
        ("a constant normal", "aten.normal.float_float", [0.0, 1.0, [n]], torch.full((n,), 0.1)),
        ("normal too wide", "aten.normal_functional.default", [x, 1.0, 2.0], 1.0 + 2.2 * torch.randn(n)),
        ("unit range", "aten.uniform.default", [x, -2.0, 5.0], uniform),
        ("past to", "aten.uniform.default", [x, -2.0, 5.0], uniform * 7.5 - 2.0),
        ("a constant uniform", "aten.uniform.default", [x, -2.0, 5.0], torch.full((n,), 1.5)),
        ("uniform squeezed", "aten.uniform.default", [x, 0.0, 1.0], uniform * 0.8 + 0.1),
        ("wrong rate", "aten.exponential.default", [x, 2.5], -torch.log1p(-uniform)),
        ("exponential zeros", "aten.exponential.default", [x, 1.0],
         torch.where(half, 0.0, -torch.log1p(-uniform))),
        ("negative exponential", "aten.exponential.default", [x, 1.0], torch.log1p(-uniform)),
        ("uniform as exponential", "aten.exponential.default", [x, 2.0], uniform),
        ("p ignored", "aten.bernoulli.Tensor", [x, torch.rand(n) ** 4], (torch.rand(n) < 0.5).float()),
        ("weight 0 drawn", "aten.multinomial.default", [weights, 20, True], weightless_pick),
        ("weights ignored", "aten.multinomial.default", [weights, 20, True], torch.randint(1, 64, (500, 20))),
        ("always the heaviest", "aten.multinomial.default", [weights, 1], weights.argmax(1, keepdim=True)),
        ("a repeat per row", "aten.multinomial.default", [weights, 2], weights.argmax(1, keepdim=True).repeat(1, 2)),
        ("out of range", "aten.multinomial.default", [weights, 3, True], torch.full((500, 3), 64)),
        ("without replacement by rank", "aten.multinomial.default", [weights, 40],
         weights.argsort(1, descending=True)[:, :40]),
    ]


@pytest.mark.parametrize("what,op,args,bad", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_a_bad_generator_is_a_mismatch(what, op, args, bad):
    graph, inputs = case_graph(op, args)
    ref = run_node(graph.nodes[0], dict(zip([r for r, _ in graph.inputs], inputs)).__getitem__)
    bad = list(bad) if isinstance(bad, tuple) else [bad.to(ref[0].dtype)]
    result = compare_distribution(op, bad, ref, args)
    assert not result.passed, f"{what}: {result.message}"
    assert result.message.startswith(RANDOM_NOTE + ": "), result.message
    assert compare_distribution(op, ref, ref, args).passed, f"torch's own draws fail: {what}"


def test_shape_dtype_and_hostile_arguments_are_verdicts():
    ref = [torch.rand(100)]
    assert "float16[100]" in compare_distribution("aten.rand.default", [torch.rand(100).half()], ref, [[100]]).message
    assert "[99]" in compare_distribution("aten.rand.default", [torch.rand(99)], ref, [[100]]).message
    for args in ([ref[0], "p"], [ref[0], 7.0], [ref[0], None]):
        r = compare_distribution("aten.bernoulli.p", ref, ref, args)
        assert not r.passed and "cannot read the arguments" in r.message
    r = compare_distribution("aten.bernoulli.default", ref, ref, [torch.rand(3)])
    assert not r.passed and "shape" in r.message
    r = compare_distribution("aten.randint.low", [torch.arange(4)], [torch.arange(4)], [5, 2, [4]])
    assert not r.passed and "empty range" in r.message
    assert not compare_distribution("aten.normal.Tensor_float", ref, ref, [ref[0]]).passed  # no model: never a pass


def test_every_random_lowering_is_judged_by_distribution():
    """The registry's random family compares no values, and each of its ops has a distribution."""
    registry = REGISTRY
    family = {op for op, low in registry.items() if low.family == "random"}
    assert family == set(RANDOM_OPS)
    assert all(not registry[op].compare_values and is_random_op(op) for op in family)
    assert not any(is_random_op(op) for op in registry if op not in family)


def test_what_cannot_be_drawn_is_refused_with_the_reason():
    caps = {"features": [], "limits": {}}
    graph, _ = case_graph("aten.randint.low", [0, 2**31 + 5, [4]], {"dtype": torch.float32})
    assert "leaves i32, and the output is float32" in supports_node(graph.nodes[0], caps)
    graph, _ = case_graph("aten.randint.low", [0, 2**31 + 5, [4]])  # int64: drawn in two words
    assert supports_node(graph.nodes[0], caps) is None
    graph, _ = case_graph("aten.rand.default", [[4]], {"dtype": torch.float64})
    assert "float64" in supports_node(graph.nodes[0], caps)
    graph, _ = case_graph("aten.bernoulli.p", [torch.rand(4), 0.5])
    bad = Node("n0", "aten.bernoulli.p", [{"ref": "x0"}, 1.5], {}, graph.nodes[0].outputs)
    assert "not a probability" in supports_node(bad, caps)


# --- a model: carved, replayed, migrated ---------------------------------------------------

NOISY_MODEL = textwrap.dedent("""
    import torch

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(16, 64)
            self.drop = torch.nn.Dropout(0.25)
            self.out = torch.nn.Linear(64, 8)

        def train(self, mode=True):  # tapml puts models in eval mode: this one stays in training
            return super().train(True)

        def forward(self, x):
            h = self.drop(torch.relu(self.inp(x)))
            keep = torch.rand_like(h) < 0.5  # a stochastic-depth style mask
            return self.out(torch.where(keep, h, h * 0.5))

    def factory():
        return Noisy(), (torch.randn(64, 16),)
""")


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    from tapml.carving import carve
    base = tmp_path_factory.mktemp("noisy")
    (base / "noisy.py").write_text(NOISY_MODEL)
    carve(f"{base / 'noisy.py'}:factory", base / "store")
    return base / "store"


def _tapml(*args):
    from tapml.cli import app
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.skipif("vulkan" not in BACKENDS, reason="no wgpu Vulkan adapter (install mesa-vulkan-drivers)")
def test_model_with_dropout_replays_and_migrates_on_vulkan(noisy, tmp_path):
    from tapml.carving import CarveStore
    store = CarveStore(noisy)
    assert {"aten.native_dropout.default", "aten.rand_like.default"} <= {c["op"] for c in store.cases}

    r = _tapml("replay", noisy, "--target", "wgpu:vulkan", "--json", tmp_path / "r.json")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output[-3000:]
    cases = json.loads((tmp_path / "r.json").read_text())["cases"]
    random_cases = [c for c in cases if is_random_op(c["op"])]
    assert len(random_cases) == 2 and all(c["status"] == "pass" for c in cases), cases
    assert all(c["message"].startswith(RANDOM_NOTE) for c in random_cases)

    r = _tapml("migrate", noisy, "--target", "wgpu:vulkan", "--state", tmp_path / "s.json")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output[-3000:]
    state = json.loads((tmp_path / "s.json").read_text())
    assert state["passed"] and state["culprits"] == [] and state["end_to_end"]["status"] == "pass"
    random_nodes = {c["node"] for c in state["cases"] if is_random_op(c["op"])}
    assert all(state["placement"]["nodes"][n] == "reference" for n in random_nodes)
    assert sum(v == "target" for v in state["placement"]["nodes"].values()) == len(store.graph.nodes) - 2
    model = [u for u in state["units"] if u["kind"] == "model"][0]
    assert "random ops kept on the reference" in model["message"] and "distribution" in model["message"]
    assert "distribution" in state["end_to_end"]["message"]


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.skipif("vulkan" not in BACKENDS, reason="no wgpu Vulkan adapter (install mesa-vulkan-drivers)")
def test_a_wrong_random_op_in_a_model_is_found(noisy, tmp_path):
    r = _tapml("replay", noisy, "--target", "wgpu:vulkan", "--inject", "aten.rand_like.default=scale:2",
               "--json", tmp_path / "r.json")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output[-3000:]
    bad = [c for c in json.loads((tmp_path / "r.json").read_text())["cases"] if c["status"] != "pass"]
    assert [c["op"] for c in bad] == ["aten.rand_like.default"] and bad[0]["status"] == "mismatch"
    assert bad[0]["message"].startswith(RANDOM_NOTE + ": ") and "outside [0, 1)" in bad[0]["message"]


SAMPLING_MODEL = textwrap.dedent("""
    import torch

    class Sampler(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(16, 50)

        def forward(self, x):
            probs = torch.softmax(self.head(x), -1)
            picks = torch.multinomial(probs, 4)  # token sampling without replacement
            many = torch.multinomial(probs, 8, replacement=True)
            # the Gumbel trick: uninitialized memory filled at random (aten.empty_permuted, then exponential)
            gumbel = probs / torch.empty_like(probs).exponential_()
            return picks, many, gumbel.argmax(-1)

    def factory():
        return Sampler(), (torch.randn(32, 16),)
""")

NOISE_MODEL = textwrap.dedent("""
    import torch

    class Noise(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(16, 64)
            self.out = torch.nn.Linear(64, 8)

        def forward(self, x):
            h = self.inp(x)
            h = torch.normal(h, 0.1)  # noise injection
            h = h + torch.empty_like(h).normal_(0.0, 0.05)
            h = h + torch.normal(torch.zeros_like(h), h.abs() * 0.01 + 0.01)
            h = h * torch.ones_like(h).uniform_(0.9, 1.1)
            return self.out(torch.relu(h))

    def factory():
        return Noise(), (torch.randn(64, 16),)
""")


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.skipif("vulkan" not in BACKENDS, reason="no wgpu Vulkan adapter (install mesa-vulkan-drivers)")
@pytest.mark.parametrize("source,ops", [
    (SAMPLING_MODEL, {"aten.multinomial.default", "aten.exponential.default"}),
    (NOISE_MODEL, {"aten.normal.Tensor_float", "aten.normal_functional.default", "aten.normal.Tensor_Tensor",
                   "aten.uniform.default"})], ids=["multinomial", "normal-noise"])
def test_model_with_sampling_or_noise_migrates_on_vulkan(source, ops, tmp_path):
    from tapml.carving import CarveStore
    (tmp_path / "model.py").write_text(source)
    r = _tapml("carve", f"{tmp_path / 'model.py'}:factory", "-o", tmp_path / "store")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output[-3000:]
    store = CarveStore(tmp_path / "store")
    assert ops <= {c["op"] for c in store.cases}

    r = _tapml("migrate", tmp_path / "store", "--target", "wgpu:vulkan", "--state", tmp_path / "s.json")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output[-3000:]
    state = json.loads((tmp_path / "s.json").read_text())
    assert state["passed"] and state["culprits"] == [] and state["end_to_end"]["status"] == "pass"
    random_cases = [c for c in state["cases"] if c["op"] in ops]
    assert {c["op"] for c in random_cases} == ops
    assert all(c["status"] == "pass" and c["message"].startswith(RANDOM_NOTE) for c in random_cases), random_cases
    assert all(state["placement"]["nodes"][c["node"]] == "reference" for c in random_cases)
    # the torch.empty_like under the fill is judged on shape and dtype (its values are arbitrary)
    empty = [c for c in state["cases"] if c["op"] == "aten.empty_permuted.default"]
    assert empty and all(c["status"] == "pass" and c["message"] == UNINITIALIZED_NOTE for c in empty), empty
