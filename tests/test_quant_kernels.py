"""Packed-weight kernels (platforms/wgsl/quant.py): the formats' bits, the device kernels against the
CPU ops, the op stage naming planted kernel bugs, and the weight staying packed on the device.

The registry's own device tiers (tests/test_wgsl_ops.py on lavapipe and llvmpipe GL, tests/test_browser.py
in Chromium, tests/test_split.py with split bindings) run every sample of the nine ops as well.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tapml.errors import Unsupported
from tapml.graph import Graph, Node, run_node
from tapml.judging.compare import compare_tensor
from tapml.platforms.wgsl import compile_graph, load_lowerings
from tapml.platforms.wgsl import quant as wgsl_quant
from tapml.platforms.wgsl.codegen import LOOP_BUDGET
from tapml.platforms.wgsl.registry import case_graph, node_flops, sample_cases
from tapml.quant import (FORMATS, INTX_LINEAR, dequantize, ggml_bytes, pack_codes, quantize_per_token_int8,
                         quantize_weight)
from support import own_wgpu, store_from_source

REGISTRY = load_lowerings()
QUANT_OPS = sorted(op for op in REGISTRY if op.startswith("tapml."))
LIMITS = {"max-storage-buffer-binding-size": 134217728, "max-storage-buffers-per-shader-stage": 8,
          "max-buffer-size": 268435456}
VULKAN_CAPS = {"adapter": "test", "backend": "vulkan", "features": ["shader-f16"], "limits": LIMITS}


def _linear_case(scheme: str, m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    packed = quantize_weight(torch.randn(n, k, generator=gen), scheme)
    x = torch.randn(m, k, generator=gen)
    if FORMATS[scheme].family == "ggml":
        return case_graph(FORMATS[scheme].linear_op, [x, packed["weight"], n, k])
    return case_graph(FORMATS[scheme].linear_op, [x, packed["weight"], packed["scales"]])


def _intx_case(bits: int, group: int, m: int, n: int, k: int, dynamic: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lo = -(1 << (bits - 1))
    codes = torch.randint(lo, -lo, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zero_point = torch.randint(lo, -lo, (n, k // group), generator=gen).to(torch.int8)
    x = torch.randn(m, k, generator=gen)
    return case_graph(INTX_LINEAR, [x, pack_codes(codes, bits), scale, zero_point, bits, group, dynamic])


# --- fast: the formats' bits and what the compiler emits ------------------------------------------

def test_ggml_dequantization_is_gguf_bit_for_bit():
    """tapml.quant reads q4_0 and q8_0 blocks exactly as gguf's own dequantizer does, the registry's
    edge blocks (zero group, largest and smallest codes, scales 65504 and -0.0) included."""
    import gguf
    gen = torch.Generator().manual_seed(1)
    for scheme in ("q4_0", "q8_0", "q5_0", "q4_k"):
        qtype = gguf.GGMLQuantizationType[scheme.upper()]
        k0 = 96 if scheme != "q4_k" else 512
        for n, k, packed in [(7, k0, quantize_weight(torch.randn(7, k0, generator=gen) * 3, scheme)),
                             (4, k0, wgsl_quant.edge_packed(scheme, torch.randn(4, k0, generator=gen))),
                             (3, 4096, quantize_weight(torch.randn(3, 4096, generator=gen), scheme))]:
            fmt = FORMATS[scheme]
            blocks = ggml_bytes(packed["weight"])[:n * k // fmt.block_elems * fmt.block_bytes].numpy()
            theirs = gguf.quants.dequantize(blocks.reshape(n, -1), qtype).astype(np.float32)
            ours = dequantize(scheme, packed, n, k).numpy()
            assert theirs.shape == ours.shape == (n, k)
            assert np.array_equal(theirs.view(np.uint32), ours.view(np.uint32)), f"{scheme} {n}x{k}: bits differ"
        if scheme == "q4_k":  # a super-block of the largest scale, mins and codes, and one all zero
            edge = dequantize(scheme, wgsl_quant.edge_packed(scheme, torch.randn(2, 512, generator=gen)), 2, 512)
            assert (edge[0, :256] == 65504 * 63 * 15).all() and (edge[1, :256] == 0).all()
            continue
        largest = {"q4_0": 7, "q8_0": 128, "q5_0": 15}[scheme]
        edge = dequantize(scheme, wgsl_quant.edge_packed(scheme, torch.randn(2, 96, generator=gen)), 2, 96)
        assert (edge[0, :32] == 0).all() and edge[0, 32:64].abs().max() == 65504 * largest
        assert torch.signbit(edge[0, 64:96]).any() and (edge[0, 64:96] == 0).all()  # a -0.0 scale


def test_kernels_count_their_loops_within_the_budget_and_pick_gemv_or_gemm():
    """K = 4096, 11008 and 14336 (llama's sizes): every loop has a trip count and a lane runs at most
    LOOP_BUDGET iterations (lavapipe cuts loops past 65 535 silently); one row takes the GEMV path,
    several rows the row-tiled GEMM, and the embedding loops not at all. The linears count as matrix
    products in a placement's FLOPs."""
    for scheme in wgsl_quant.LAYOUTS:  # the formats with kernels
        for k in (4096, 11008, 14336):
            for m, path in ((1, "gemv"), (17, "gemm")):
                program = compile_graph(_linear_case(scheme, m, 3, k)[0], VULKAN_CAPS)
                (kern,) = program.kernels
                assert kern.name.startswith(f"{scheme}_{path}"), kern.name
                assert kern.loop_iterations is not None and 0 < kern.loop_iterations <= LOOP_BUDGET, (scheme, k, m)
                assert "workgroupBarrier" in kern.wgsl if path == "gemv" else True
                assert "enable f16" not in kern.wgsl or FORMATS[scheme].scale_dtype == "float16"
        graph, _ = sample_cases(FORMATS[scheme].embedding_op)[0]
        assert all(kern.loop_iterations == 0 for kern in compile_graph(graph, VULKAN_CAPS).kernels)
        k = FORMATS[scheme].block_elems * 2
        graph, _ = _linear_case(scheme, 5, 3, k)
        assert node_flops(graph.nodes[0], graph.meta) == 2 * 5 * 3 * k  # a matrix product's 2·M·N·K
    for bits, group, dynamic in ((4, 32, True), (4, 128, False), (8, None, False)):
        for k in (4096, 11008, 14336):
            for m, path in ((1, "gemv"), (17, "gemm")):
                kernels = compile_graph(_intx_case(bits, group or k, m, 3, k, dynamic)[0], VULKAN_CAPS).kernels
                assert [kern.name.rsplit("_", 1)[0] for kern in kernels] == ["per_token_int8"] * dynamic + [f"intx_{path}"]
                assert all(0 < kern.loop_iterations <= LOOP_BUDGET for kern in kernels), (bits, group, k, m)
    graph, _ = _intx_case(4, 32, 5, 3, 64, True)
    assert node_flops(graph.nodes[0], graph.meta) == 2 * 5 * 3 * 64


def test_the_device_holds_the_packed_weight_and_no_float_copy():
    """The weight's buffer of a q4_0 linear is its blocks' bytes (N*K/32 blocks of 18 bytes, rounded up
    to a word), and no buffer of the program could hold a float copy: every buffer is an input as sent,
    or the output. The same for each format's linear and embedding; torchao's codes (intx_linear) are
    their packed words, and 8da4w adds only each row's scale and zero point."""
    n, k, m = 40, 4096, 3
    graph, inputs = _linear_case("q4_0", m, n, k)
    program = compile_graph(graph, VULKAN_CAPS)
    sizes = {b.name: b.size for b in program.buffers}
    weight = program.inputs[1]
    assert sizes[weight] == -(-n * k // 32 * 18 // 4) * 4 == inputs[1].numel() * 4 == 92160
    assert sorted(sizes.values()) == sorted([m * k * 4, 92160, m * n * 4])  # x, the blocks, the output
    assert max(sizes.values()) < n * k * 2  # not even a float16 copy of the weight would fit
    for scheme, fmt in ((s, FORMATS[s]) for s in wgsl_quant.LAYOUTS):
        for graph, inputs in [_linear_case(scheme, 1, n, k)] + sample_cases(fmt.embedding_op)[:1]:
            program = compile_graph(graph, VULKAN_CAPS)
            sent = sorted(-(-t.numel() * t.element_size() // 4) * 4 if t.dtype != torch.int64 else t.numel() * 4
                          for t in inputs)
            held = sorted(b.size for b in program.buffers if b.role == "input")
            assert held == sent, (scheme, held, sent)
            assert [b.role for b in program.buffers].count("temp") == 0
    for bits, group, dynamic in ((4, 32, True), (8, k, False)):
        graph, inputs = _intx_case(bits, group, m, n, k, dynamic)
        program = compile_graph(graph, VULKAN_CAPS)
        sizes = {name: next(b.size for b in program.buffers if b.name == name) for name in program.inputs}
        assert sizes[program.inputs[1]] == n * k * bits // 8 == inputs[1].numel() * 4  # the codes as packed
        assert sizes[program.inputs[3]] == n * (k // group) * 4  # int8 zero points held as i32
        temps = [b.meta.shape for b in program.buffers if b.role == "temp"]
        assert temps == ([(m, 3)] if dynamic else [])  # 8da4w: each row's scale and zero point, nothing more
        assert sum(b.size for b in program.buffers) < n * k * 2 + m * k * 4 + m * n * 4  # no float16 weight copy fits


def test_packed_sizes_that_disagree_are_unsupported_with_the_reason():
    graph, inputs = _linear_case("q4_0", 1, 8, 64)
    node = graph.nodes[0]
    wrong = Node(node.name, node.op, [node.args[0], node.args[1], 9, 64], {}, node.outputs)  # 9 rows in 8 rows' blocks
    with pytest.raises(Unsupported, match=r"q4_0: a packed 9x64 weight is 81 int32 words, not \[72\]"):
        compile_graph(Graph(graph.inputs, [wrong], graph.outputs), VULKAN_CAPS)


# --- device: the kernels against the CPU ops, on lavapipe ------------------------------------------

@pytest.fixture(scope="module")
def guarded_vulkan():
    """A Vulkan platform of this module's own that checks every run for writes past a buffer's end."""
    platform = own_wgpu("vulkan")
    assert platform.enable_guards()
    yield platform
    platform.close()


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_device_kernels_match_the_cpu_ops_with_outputs_poisoned(guarded_vulkan):
    """Every registry sample of the eight ops, plus llama-sized K, on lavapipe with guards: outputs start
    as poison (NaN: every byte 0xFF) each run, so an element a kernel leaves unwritten cannot pass, and no
    write lands past a buffer's end. A GEMV cut to its first workgroup shows the poison."""
    platform = guarded_vulkan
    cases = [(op, *case) for op in QUANT_OPS for case in sample_cases(op)]
    cases += [(f"{s} K={k}", *_linear_case(s, m, 3, k)) for s in ("q4_0", "q4f16_1") for k, m in ((11008, 1), (14336, 2))]
    cases += [(f"intx {bits}-bit g{group} dynamic={dynamic} M={m}", *_intx_case(bits, group, m, 3, 11008, dynamic))
              for bits, group, m, dynamic in ((4, 32, 1, True), (4, 32, 2, True), (8, 11008, 1, False), (4, 128, 2, False))]
    for name, graph, inputs in cases:
        out = platform.run(platform.compile(graph), inputs)[0]
        ref = run_node(graph.nodes[0], dict(zip([r for r, _ in graph.inputs], inputs)).__getitem__)[0]
        assert out.dtype == ref.dtype and out.shape == ref.shape, name
        assert not out.isnan().any(), f"{name}: an output element was never written"
        res = compare_tensor(out, ref)
        assert res.passed, f"{name} {[tuple(t.shape) for t in inputs]}: {res.message}"
    graph, inputs = _linear_case("q8_0", 1, 100, 64)
    program = compile_graph(graph, platform.caps())  # not the platform's kept program: it is cut below
    assert program.kernels[0].workgroups[0] > 1
    program.kernels[0].workgroups = (1, 1, 1)
    out = platform.run(program, inputs)[0]
    written = ~out.isnan()
    assert written.any() and not written.all()  # the first workgroup's columns only: the rest is poison


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_per_token_int8_codes_on_the_device_are_torchaos(guarded_vulkan):
    """8da4w's activation quantization on lavapipe gives exactly torchao's codes: through an identity
    weight of 8-bit codes (scale 1, zero point 0) intx_linear returns the quantized-then-dequantized input
    itself, compared bit for bit with ``quantize_per_token_int8`` on every dynamic registry sample's input
    (an all-zero row, one huge value, a row of exact .5 ties that round to even) and rows spanning six
    decades, whole rows of 4096 included; the stats kernel's temp buffer is the only one added."""
    platform = guarded_vulkan
    xs = [args[0].reshape(-1, args[0].shape[-1]).float() for args, _ in wgsl_quant.intx_samples() if args[6]]
    gen = torch.Generator().manual_seed(5)
    xs.append(torch.randn(32, 128, generator=gen) * torch.logspace(-3, 3, 32).unsqueeze(1))
    ties = wgsl_quant.intx_edge_input(torch.ones(3, 64))[2:]
    assert (torch.frac((ties * 16).abs()[:, 2:]) == 0.5).all()  # every value a tie, as the docstring says
    compared = 0
    for x in xs + [ties]:
        K = x.shape[1]
        picked = torch.arange(0, K, max(1, K // 128))  # columns to read back (the whole row sets the scale)
        eye = torch.zeros(len(picked), K, dtype=torch.int64)
        eye[torch.arange(len(picked)), picked] = 1
        graph, inputs = case_graph(INTX_LINEAR, [x, pack_codes(eye, 8), torch.ones(len(picked), 1),
                                                 torch.zeros(len(picked), 1, dtype=torch.int8), 8, K, True])
        program = platform.compile(graph)
        assert [b.meta.shape for b in program.buffers if b.role == "temp"] == [(x.shape[0], 3)]
        out = platform.run(program, inputs)[0]
        expected = quantize_per_token_int8(x)[:, picked]
        assert torch.equal(out, expected), f"{tuple(x.shape)}: {int((out != expected).sum())} codes differ"
        compared += out.numel()
    assert compared > 5000


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_division_is_moved_to_the_correctly_rounded_quotient(guarded_vulkan):
    """tap_div_fix, which the per-token kernel's three divisions go through (WGSL lets a division be 2.5
    ULP off; SwiftShader's is), turns a quotient up to two ULP off either way into torch's float32 a / b,
    bit for bit: random operands over many binades, quotients at a binade's edge and exact ones."""
    from tapml.graph import TensorMeta
    from tapml.platforms.base import BufferSpec, Kernel, KernelProgram
    from tapml.platforms.wgsl.helpers import HELPERS
    gen = torch.Generator().manual_seed(9)
    n = 20000
    a = torch.exp2(torch.randint(-60, 60, (n,), generator=gen).float()) * (1 + torch.rand(n, generator=gen))
    b = torch.exp2(torch.randint(-60, 60, (n,), generator=gen).float()) * (1 + torch.rand(n, generator=gen))
    b[:2000] = 255.0
    a[2000:3000] = b[2000:3000] * torch.randint(1, 300, (1000,), generator=gen).float()  # exact quotients
    a[3000:4000] = b[3000:4000] * (2.0 - 2.0 ** -23)  # next to a binade's edge
    off = torch.randint(-2, 3, (n,), generator=gen).to(torch.int32)  # how many ULP the start is off
    helpers = [HELPERS[h][1] for h in ("tap_mul_u64", "tap_cmp_scaled", "tap_div_fix")]
    wgsl = "\n".join(["@group(0) @binding(0) var<storage, read> a: array<f32>;",
                      "@group(0) @binding(1) var<storage, read> b: array<f32>;",
                      "@group(0) @binding(2) var<storage, read> off: array<i32>;",
                      "@group(0) @binding(3) var<storage, read_write> q: array<f32>;", *helpers,
                      "@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {",
                      f"  let i = g.x; if (i >= {n}u) {{ return; }}",
                      "  let start = bitcast<f32>(u32(i32(bitcast<u32>(a[i] / b[i])) + off[i]));",
                      "  q[i] = tap_div_fix(a[i], b[i], start);", "}"])
    f, i = TensorMeta((n,), "float32"), TensorMeta((n,), "int32")
    program = KernelProgram(kind="wgsl", inputs=["a", "b", "off"], outputs=["q"],
                            buffers=[BufferSpec("a", "f32", 4 * n, "input", f), BufferSpec("b", "f32", 4 * n, "input", f),
                                     BufferSpec("off", "i32", 4 * n, "input", i), BufferSpec("q", "f32", 4 * n, "output", f)],
                            kernels=[Kernel("div", wgsl, [("a", "read"), ("b", "read"), ("off", "read"), ("q", "read_write")],
                                            (-(-n // 64), 1, 1))],
                            input_meta=[f, f, i], output_meta=[f])
    (q,) = guarded_vulkan.run(program, [a, b, off])
    expected = a / b
    wrong = (q.view(torch.int32) != expected.view(torch.int32)).nonzero().flatten()
    assert not len(wrong), f"{len(wrong)} quotients wrong, e.g. {a[wrong[0]].item()!r} / {b[wrong[0]].item()!r}"
    assert (off != 0).sum() > n // 2


# --- the op stage names planted kernel bugs -----------------------------------------------------

QUANT_MODEL = '''
import torch
from tapml.quant import define_ops, pack_codes, quantize_weight


class QuantModel(torch.nn.Module):
    """An embedding and four linears, one per packed format (torchao's 8da4w the fourth), as a quantized
    model holds them."""

    def __init__(self):
        super().__init__()
        define_ops()
        gen = torch.Generator().manual_seed(7)
        table, w40, w80, w41 = (torch.randn(n, 64, generator=gen) for n in (12, 32, 32, 16))
        self.register_buffer("table", quantize_weight(table, "q4_0")["weight"])
        self.register_buffer("w40", quantize_weight(w40, "q4_0")["weight"])
        self.register_buffer("w80", quantize_weight(w80, "q8_0")["weight"])
        mlc = quantize_weight(w41, "q4f16_1")
        self.register_buffer("w41", mlc["weight"])
        self.register_buffer("s41", mlc["scales"])
        self.register_buffer("wx", pack_codes(torch.randint(-8, 8, (8, 16), generator=gen), 4))
        self.register_buffer("sx", torch.rand(8, 1, generator=gen) * 0.1 + 0.01)
        self.register_buffer("zx", torch.randint(-8, 8, (8, 1), generator=gen).to(torch.int8))

    def forward(self, ids):
        h = torch.ops.tapml.q4_0_embedding(self.table, ids, 12, 64, torch.float32)
        a = torch.ops.tapml.q4_0_linear(h, self.w40, 32, 64)
        b = torch.ops.tapml.q8_0_linear(h, self.w80, 32, 64)
        c = torch.ops.tapml.q4f16_1_linear(torch.cat([a, b], -1), self.w41, self.s41)
        return torch.ops.tapml.intx_linear(c, self.wx, self.sx, self.zx, 4, 16, True)


def factory():
    return QuantModel(), (torch.tensor([[3, 0, 11, 5]]),)
'''


def _swapped_nibbles(word: str, i: int) -> str:
    return f"(({word} >> {4 * (i ^ 1)}u) & 15u)"  # the two nibbles of each byte read the wrong way round


def _zero_extended(word: str, i: int, bits: int) -> str:
    return f"bitcast<i32>(({word} >> {bits * i}u) & {(1 << bits) - 1}u)"  # the sign extension dropped


def _scale_of_the_next_group(original):
    def scale(self, k, n, g):
        return original(self, k, n, f"({g} ^ 1)")
    return scale


PLANTED = {  # fault -> (how to plant it, the ops whose cases it must fail)
    "wrong nibble order": (lambda mp: mp.setattr(wgsl_quant, "nibble", _swapped_nibbles),
                           {"tapml.q4_0_embedding.default", "tapml.q4_0_linear.default", "tapml.q4f16_1_linear.default"}),
    "q4_0 zero point q-7": (lambda mp: mp.setattr(wgsl_quant.Q4_0, "zero", 7),
                            {"tapml.q4_0_embedding.default", "tapml.q4_0_linear.default"}),
    "mlc zero point q-8": (lambda mp: mp.setattr(wgsl_quant.MlcGroups, "zero", 8), {"tapml.q4f16_1_linear.default"}),
    "scale of the wrong group": (lambda mp: [mp.setattr(cls, "scale", _scale_of_the_next_group(cls.scale))
                                             for cls in (wgsl_quant.GgmlBlocks, wgsl_quant.MlcGroups)],
                                 {"tapml.q4_0_embedding.default", "tapml.q4_0_linear.default",
                                  "tapml.q8_0_linear.default", "tapml.q4f16_1_linear.default"}),
    "sign extension dropped": (lambda mp: mp.setattr(wgsl_quant, "signed_code", _zero_extended),
                               {"tapml.q8_0_linear.default", "tapml.intx_linear.default"}),
    "intx zero point ignored": (lambda mp: mp.setattr(wgsl_quant.IntxGroups, "zero_point", lambda self, k, n, g: "0"),
                                {"tapml.intx_linear.default"}),
}


@pytest.fixture(scope="module")
def quant_store(tmp_path_factory):
    return store_from_source(tmp_path_factory, "quant_model", QUANT_MODEL)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_the_op_stage_names_each_planted_kernel_bug(guarded_vulkan, quant_store, monkeypatch):
    """Replay of a carved model holding the packed-weight ops: it passes as lowered, and each bug planted
    into the lowering (wrong nibble order, an off-by-one zero point, the scale of the wrong group, the
    sign extension of signed codes dropped, torchao's zero points ignored) makes
    exactly the cases of the ops it touches mismatch, each verdict naming its op and node."""
    from tapml.driving.replay import replay
    platform = guarded_vulkan
    ops = {c["op"] for c in quant_store.cases}
    assert {"tapml.q4_0_embedding.default", "tapml.q4_0_linear.default", "tapml.q8_0_linear.default",
            "tapml.q4f16_1_linear.default", "tapml.intx_linear.default"} <= ops

    def verdicts():
        platform.__dict__.pop("_compiled", None)  # compiled programs are kept by graph: compile again
        return replay(quant_store, platform, "wgpu:vulkan")["cases"]

    assert all(v["status"] == "pass" for v in verdicts())
    for fault, (plant, broken) in PLANTED.items():
        with monkeypatch.context() as mp:
            plant(mp)
            result = verdicts()
        failed = {v["op"] for v in result if v["status"] != "pass"}
        assert failed == broken, f"{fault}: failed {sorted(failed)}, expected {sorted(broken)}"
        for v in result:
            if v["op"] in broken:
                assert v["status"] == "mismatch" and v["node"] and v["max_abs_err"] > 0, (fault, v)
    assert all(v["status"] == "pass" for v in verdicts())  # nothing planted is left behind


# --- whole model: torchao's schemes generate on the device, every node there ----------------------

@pytest.mark.slow
@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_torchao_schemes_generate_on_vulkan_with_no_node_falling_back(tmp_path):
    """`tapml generate zoo:tiny-llama --quantize int4|8da4w --target wgpu:vulkan --tokens 4` exits 0 with
    every prefill and decode node on the target: the intx linears run as packed-weight kernels (8da4w's
    per-token quantization on the device too), every step passes and the tokens are the reference's."""
    import json

    from typer.testing import CliRunner

    from tapml.cli import app
    for scheme in ("int4", "8da4w"):
        report = tmp_path / f"{scheme}.json"
        r = CliRunner().invoke(app, ["generate", "zoo:tiny-llama", "--quantize", scheme, "--target", "wgpu:vulkan",
                                     "--tokens", "4", "--json", str(report)])
        assert r.exit_code == 0, r.output
        doc = json.loads(report.read_text())
        for stage in ("prefill", "decode"):
            placement = doc["placement"][stage]
            assert placement["fell_back"] == 0 and placement["on_target"] == placement["nodes"] > 0, (scheme, placement)
        assert doc["target_tokens"] == doc["reference_tokens"] and len(doc["steps"]) == 5
        assert all(step["status"] == "pass" for step in doc["steps"]), scheme
