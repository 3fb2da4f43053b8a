"""``--quantize`` (issue 33, items 1, 2 and 7): every Linear and Embedding of a model packed in
llama.cpp's or MLC-LLM's format, one op per quantized linear in the exported graph whose inputs are
the packed bytes, the reference running the same codes; bad schemes and models refused (exit 2)."""

import json

import pytest
import torch
from support import in_chromium, vulkan_or_skip
from typer.testing import CliRunner

from tapml import quant
from tapml.errors import TapmlError
from tapml.judging.verdict import MigrationState
from tapml.ops import resolve_op


def tapml(*args):
    from tapml.cli import app
    return CliRunner().invoke(app, [str(a) for a in args])


def test_mlc_layout_is_eight_codes_per_word_lowest_nibble_first():
    # one row of 32 weights whose codes are 0..14 then 14..0 (and a 7: zero) at a scale of 1
    codes = list(range(15)) + list(range(14, -1, -1)) + [7, 7]
    w = torch.tensor([c - 7.0 for c in codes]).reshape(1, 32)
    for scheme in ("q4f16_1", "q4f32_1"):
        packed = quant.quantize_weight(w, scheme)
        assert packed["scales"].dtype == getattr(torch, quant.FORMATS[scheme].scale_dtype)
        assert packed["scales"].tolist() == [[1.0]]
        words = [x & 0xFFFFFFFF for x in packed["weight"].reshape(-1).tolist()]
        expected = [sum(c << (4 * i) for i, c in enumerate(codes[j:j + 8])) for j in range(0, 32, 8)]
        assert words == expected
        assert torch.equal(quant.dequantize(scheme, packed, 1, 32), w)


def test_ggml_blocks_are_gguf_bytes_and_round_trip():
    import gguf
    g = torch.Generator().manual_seed(3)
    w = torch.randn(5, 96, generator=g)
    w[1, 32:64] = 0.0  # an all-zero block: scale 0, every weight 0
    for scheme in ("q4_0", "q8_0"):
        packed = quant.quantize_weight(w, scheme)["weight"]
        qtype = gguf.GGMLQuantizationType[scheme.upper()]
        raw = gguf.quants.quantize(w.numpy(), qtype).tobytes()
        assert packed.dtype == torch.int32 and packed.numel() == quant.ggml_words(5, 96, quant.FORMATS[scheme])
        assert quant.ggml_bytes(packed).numpy().tobytes()[:len(raw)] == raw
        theirs = gguf.quants.dequantize(quant.ggml_bytes(packed).numpy()[:len(raw)].reshape(5, -1), qtype)
        assert torch.equal(quant.dequantize(scheme, {"weight": packed}, 5, 96), torch.from_numpy(theirs))
        assert (quant.dequantize(scheme, {"weight": packed}, 5, 96)[1, 32:64] == 0).all()


def test_ops_are_in_the_vocabulary_and_check_what_they_are_given():
    g = torch.Generator().manual_seed(0)
    for scheme, fmt in quant.FORMATS.items():
        if not fmt.quantizable:
            continue
        k = 2 * fmt.block_elems
        w, x = torch.randn(6, k, generator=g), torch.randn(3, k, generator=g)
        op = resolve_op(fmt.linear_op)
        packed = quant.quantize_weight(w, scheme)
        args = (packed["weight"], 6, k) if fmt.family == "ggml" else (packed["weight"], packed["scales"])
        out = op(x, *args)
        assert torch.allclose(out, x @ quant.dequantize(scheme, packed, 6, k).T, atol=1e-5)
        assert op(x.half(), *args).dtype == torch.float16
        with pytest.raises(ValueError, match="features"):
            op(x[:, :32], *args)
        emb = resolve_op(fmt.embedding_op)
        ids = torch.tensor([[5, 0, 2]])
        eargs = (packed["weight"], ids, 6, k, torch.float32) if fmt.family == "ggml" else \
            (packed["weight"], packed["scales"], ids, torch.float32)
        assert torch.equal(emb(*eargs), quant.dequantize(scheme, packed, 6, k)[ids])
        with pytest.raises(ValueError, match="outside"):
            bad = list(eargs)
            bad[1 if fmt.family == "ggml" else 2] = torch.tensor([6])
            emb(*bad)
    with pytest.raises(ValueError, match="holds 54 int32 words"):  # a packed tensor of the wrong size
        resolve_op("tapml.q4_0_linear.default")(torch.randn(3, 64), torch.zeros(53, dtype=torch.int32), 6, 64)
    for name in ("tapml.q4_0_linear.Tensor", "tapml.linear.default", "tapml.q4_0_linear.default.x", "evil.q4_0.default"):
        with pytest.raises(ValueError, match="refused"):
            resolve_op(name)


def test_packed_positions_are_the_ops_packed_arguments_by_their_schemas():
    """Every packed-weight op's packed arguments, as its torch schema names them; none for others."""
    quant.define_ops()
    for name in quant.OPS:
        schema = quant.op(name)._schema
        named = [schema.arguments[i].name for i in quant.packed_positions(f"tapml.{name}.default")]
        assert named and set(named) <= {"weight", "scales", "scale", "zero_point"}, name
        assert {a.name for a in schema.arguments} & {"weight", "scales", "scale", "zero_point"} == set(named), name
    assert quant.packed_positions("aten.mm.default") == quant.packed_positions("tapml.nothing.default") == ()


def test_formats_read_from_gguf_only_are_ops_whose_reference_is_ggufs_dequantizer():
    """Q6_K, Q4_1 and the other types tapml reads but does not write: their blocks (here random bytes
    with a small float16 scale, as no gguf quantizer writes Q6_K) are one op's input, the op computes
    with exactly what gguf dequantizes, the sizes are checked, and ``--quantize`` does not offer them."""
    import gguf
    g = torch.Generator().manual_seed(3)
    for scheme in ("q6_k", "q4_1", "q5_k", "q2_k"):
        fmt = quant.FORMATS[scheme]
        assert not fmt.quantizable and scheme not in quant.SCHEMES
        rows, cols = 3, 2 * fmt.block_elems
        raw = torch.randint(0, 256, (rows * cols // fmt.block_elems, fmt.block_bytes), generator=g, dtype=torch.uint8)
        halves = {"q6_k": [fmt.block_bytes - 2], "q4_1": [0, 2], "q5_k": [0, 2], "q2_k": [80, 82]}[scheme]
        for at in halves:  # the blocks' float16 scales: small, finite
            raw[:, at:at + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        packed = {"weight": quant.ggml_tensor(raw.numpy().tobytes())}
        theirs = gguf.quants.dequantize(raw.reshape(rows, -1).numpy(), gguf.GGMLQuantizationType[scheme.upper()])
        w = quant.dequantize(scheme, packed, rows, cols)
        assert torch.equal(w, torch.from_numpy(theirs)) and w.abs().max() > 0
        x = torch.randn(2, cols, generator=g)
        out = resolve_op(fmt.linear_op)(x, packed["weight"], rows, cols)
        assert torch.allclose(out, x @ w.T, atol=1e-4)
        with pytest.raises(ValueError, match="int32 words"):
            resolve_op(fmt.linear_op)(x, packed["weight"][:-1], rows, cols)
        with pytest.raises(ValueError, match="does not write"):
            quant.quantize_weight(torch.randn(rows, cols), scheme)


def test_logits_judged_as_distributions_name_the_planted_faults_a_tolerance_may_miss():
    """The whole-model judge of a quantized model: logits of the same codes agree far inside the
    thresholds; a wrong nibble order or a scale of the wrong group moves the distributions past them,
    while a near-tie (the reference's top two within the tolerance) is no disagreement."""
    from tapml.judging.compare import LOGITS_THRESHOLDS, logits_agreement
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(64, 96, generator=g), torch.randn(12, 96, generator=g)
    packed = quant.quantize_weight(w, "q4f16_1")
    right = x @ quant.dequantize("q4f16_1", packed, 64, 96).T
    same = logits_agreement(right + 1e-6 * torch.randn(right.shape, generator=g), right, 1e-4, 1e-5)
    assert same["status"] == "pass" and same["positions"] == 12 and same["mean_kl"] < 1e-9
    assert same["top1_agreement"] == 1.0 and same["thresholds"] == LOGITS_THRESHOLDS
    swapped = packed["weight"].view(torch.uint8).reshape(-1, 4)  # each byte's nibbles swapped
    swapped = (((swapped & 0xF) << 4) | (swapped >> 4)).reshape(64, -1).view(torch.int32)
    wrong_scales = packed["scales"].roll(1, dims=1)
    for fault in ({"weight": swapped, "scales": packed["scales"]}, {"weight": packed["weight"], "scales": wrong_scales}):
        bad = logits_agreement(x @ quant.dequantize("q4f16_1", fault, 64, 96).T, right, 1e-4, 1e-5)
        assert bad["status"] == "fail" and bad["mean_kl"] > LOGITS_THRESHOLDS["mean_kl"], bad
    poisoned = right.clone()
    poisoned[3, 7], poisoned[5, 0] = float("nan"), float("inf")  # no distribution: a failure, and JSON-safe
    bad = logits_agreement(poisoned, right, 1e-4, 1e-5)
    assert bad["status"] == "fail" and bad["nonfinite"] == 2 and bad["top1_agreement"] == 10 / 12
    assert json.loads(json.dumps(bad, allow_nan=False)) == bad and bad["mean_kl"] < 1e-9
    tie = torch.tensor([[1.0, 1.0 - 1e-7, -3.0]])
    assert logits_agreement(torch.tensor([[1.0 - 1e-7, 1.0, -3.0]]), tie, 1e-4, 1e-5)["top1_agreement"] == 1.0


def test_quantized_llama_holds_packed_ops_and_runs_the_same_codes(tmp_path):
    from tapml.carving import open_or_carve
    from tapml.carving.store import CarveStore
    from tapml.frontends.models import load_model
    from tapml.frontends.quantize import QuantizedLinear, packed_bytes

    plain, inputs = load_model("zoo:tiny-llama")
    model, _ = load_model("zoo:tiny-llama", quantize="q4_0")
    assert not any(type(m) in (torch.nn.Linear, torch.nn.Embedding) for m in model.modules())
    sizes = packed_bytes(model)
    floats = sum(p.numel() * 4 for name, p in plain.named_parameters() if p.dim() == 2)
    assert sizes["packed"] <= floats * 0.15  # 4.5 bits a weight against 32
    with torch.no_grad():
        ref, out = plain(*inputs).logits, model(*inputs).logits
    assert (ref - out).abs().max() > 0  # the codes, not the float weights
    assert torch.nn.functional.cosine_similarity(ref.flatten(), out.flatten(), dim=0) > 0.95

    out_dir = tmp_path / "store"
    assert tapml("carve", "zoo:tiny-llama", "--quantize", "q4f16_1", "-o", out_dir).exit_code == 0
    store = CarveStore(out_dir)
    assert store.quantize == "q4f16_1" and store.dtype == "float32"  # float16 scales are the format's
    ops = {n.op for n in store.graph.nodes}
    assert {"tapml.q4f16_1_linear.default", "tapml.q4f16_1_embedding.default"} <= ops
    assert not {"aten.mm.default", "aten.addmm.default", "aten.embedding.default"} & ops
    linear = next(n for n in store.graph.nodes if n.op == "tapml.q4f16_1_linear.default")
    metas = [store.graph.meta[a["ref"]] for a in linear.args[1:3]]
    assert [m.dtype for m in metas] == ["int32", "float16"]
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == len(
        [n for n in store.graph.nodes if n.op == "tapml.q4f16_1_linear.default"])

    # a store reused for a migration must have been carved with the same --quantize
    with pytest.raises(TapmlError, match="is a store: --quantize"):
        open_or_carve(str(out_dir), quantize="q4_0")
    manifest = json.loads((out_dir / "manifest.json").read_text())
    manifest["quantize"] = "q9_9"
    (out_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TapmlError, match="quantize"):
        CarveStore(out_dir)


def test_bad_quantize_input_exits_2(tmp_path):
    r = tapml("generate", "zoo:tiny-llama", "--quantize", "q5_1")
    assert r.exit_code == 2 and "choose one of q4_0, q8_0, q5_0, q4_k, q4f16_1, q4f32_1, int8, int4" in r.output
    r = tapml("carve", "zoo:cnn", "--quantize", "q8_0", "-o", tmp_path / "cnn")
    assert r.exit_code == 2 and "rows of 16 weights" in r.output and "groups of 32" in r.output
    assert not (tmp_path / "cnn").exists()
    assert tapml("carve", "zoo:mlp", "--quantize", "q4_0", "-o", tmp_path / "q").exit_code == 0
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    node = next(n for n in manifest["nodes"] if n["op"] == "tapml.q4_0_linear.default")
    node["args"][2] += 1  # out_features: the packed blocks no longer hold the weight the node says
    (tmp_path / "q" / "manifest.json").write_text(json.dumps(manifest))
    r = tapml("replay", tmp_path / "q", "--target", "reference")
    assert r.exit_code == 2 and "int32 words" in r.output and "carve the model again" in r.output, r.output
    assert tapml("carve", "zoo:mlp", "-o", tmp_path / "mlp").exit_code == 0
    r = tapml("migrate", tmp_path / "mlp", "--quantize", "q4_0", "--state", tmp_path / "s.json")
    assert r.exit_code == 2 and "keeps the weights it was carved with" in r.output
    r = tapml("carve", tmp_path / "model.pt2", "--quantize", "q4_0", "-o", tmp_path / "x")
    assert r.exit_code == 2 and "exported program" in r.output


def test_precision_reports_the_quality_of_a_scheme_apart_from_the_verdict(tmp_path):
    """`tapml precision zoo:tiny-llama --quantize q4_0 --json p.json`: the float16 analysis of the quantized
    model, and its quality against float32 (SQNR per quantized layer, mean KL, same top-1, perplexity), which
    q8_0 beats; the document reads back into an HTML report that shows it."""
    from tapml.driving.quantization import quantization_quality
    r = tapml("precision", "zoo:tiny-llama", "--quantize", "q4_0", "--json", tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    assert "quantization q4_0 (quality, not a verdict): mean KL" in r.output
    q = json.loads((tmp_path / "p.json").read_text())["quantization"]
    assert q["scheme"] == "q4_0" and q["tokens"] == 16 and len(q["layers"]) == 16  # 14 linears, embedding, head
    assert q["layers"][0] == {"module": "model.embed_tokens", "kind": "embedding", "sqnr_db": q["layers"][0]["sqnr_db"]}
    assert all(8 < layer["sqnr_db"] < 30 for layer in q["layers"])  # 4-bit: about 6 dB a bit, less the outliers
    assert 0 < q["mean_kl"] <= q["max_kl"] and 0 <= q["top1_agreement"] <= 1
    assert q["perplexity"]["float"] > 1 and q["perplexity"]["quantized"] > 1
    assert q["weight_bytes"]["packed"] * 7 < q["weight_bytes"]["float_of_packed"]
    q8 = quantization_quality("zoo:tiny-llama", "q8_0")
    assert min(layer["sqnr_db"] for layer in q8["layers"]) > max(layer["sqnr_db"] for layer in q["layers"])
    assert q8["mean_kl"] < q["mean_kl"] / 10
    r = tapml("report", tmp_path / "p.json", "-o", tmp_path / "p.html")
    assert r.exit_code == 0, r.output
    html = (tmp_path / "p.html").read_text()
    assert "Quantization q4_0 against float32" in html and "model.layers.1.mlp.down_proj" in html
    r = tapml("precision", "zoo:tiny-llama", "--text-file", tmp_path / "p.json")
    assert r.exit_code == 2 and "--text-file belongs to --quantize" in r.output
    r = tapml("precision", "zoo:tiny-llama", "--quantize", "q4_0", "--text-file", tmp_path / "p.json")
    assert r.exit_code == 2 and "needs a tokenizer" in r.output


def test_torchao_schemes_run_torchaos_codes_as_one_op_each():
    """int8, int4 and 8da4w go through torchao's own configs (quantize_): each linear becomes one
    tapml.intx_linear node holding torchao's codes (packed into words), scales and zero points, and
    computes what torchao's quantized model computes (8da4w's int8 per-token activations included)."""
    from torchao.quantization import quantize_

    from tapml.frontends.models import load_model
    from tapml.frontends.quantize import IntxLinear, quantize_model, torchao_config
    codes = torch.tensor([[-8, 7, 0, -1, 3, -5, 6, 1], [127, -128, 0, -1, 5, 9, -77, 64]])
    assert torch.equal(quant.unpack_codes(quant.pack_codes(codes[:1], 4), 4), codes[:1])
    assert torch.equal(quant.unpack_codes(quant.pack_codes(codes, 8), 8), codes)
    assert quant.pack_codes(codes[:1], 4).tolist() == [[int.from_bytes(bytes([0x78, 0xF0, 0xB3, 0x16]), "little",
                                                                      signed=True)]]
    for scheme, tol in (("int8", 1e-6), ("int4", 0.0), ("8da4w", 0.0)):
        model, inputs = load_model("zoo:tiny-llama", quantize=scheme)
        theirs, _ = load_model("zoo:tiny-llama")
        quantize_(theirs, torchao_config(scheme))
        linears = [m for m in model.modules() if isinstance(m, IntxLinear)]
        assert len(linears) == 15 and all(m.weight.dtype == torch.int32 for m in linears)
        assert linears[0].group_size == (64 if scheme == "int8" else 32)
        assert linears[0].weight.numel() * 32 == 64 * 64 * linears[0].bits  # packed: no int8 per weight
        with torch.no_grad():
            assert (model(*inputs).logits - theirs(*inputs).logits).abs().max() <= tol
        ep = torch.export.export(model, inputs)
        assert sum(n.target == torch.ops.tapml.intx_linear.default for n in ep.graph.nodes) == 15
    x = torch.tensor([[0.5, -1.0, 3.0, 0.0]])
    q = quant.quantize_per_token_int8(x)
    assert torch.allclose(q, x, atol=4.0 / 255) and q[0, 3] == 0  # the range holds zero exactly
    with pytest.raises(ValueError, match="group_size 48 does not divide"):
        resolve_op(quant.INTX_LINEAR)(torch.randn(2, 64), torch.zeros(4, 8, dtype=torch.int32),
                                      torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int8), 4, 48, False)
    r = tapml("carve", "zoo:tiny-llama", "--quantize", "int4_g128", "-o", "/nonexistent/never")
    assert r.exit_code == 2 and "groups of 128" in r.output


def _migrated_quantized_ops(state) -> set[str]:
    doc = json.loads(state.read_text())
    assert doc["passed"] and doc["end_to_end"]["status"] == "pass"
    return {c["op"] for c in doc["cases"] if c["op"].startswith("tapml.") and c["status"] == "pass"}


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
def test_q4_k_model_migrates_whole_on_gl_and_generates_on_vulkan(tmp_path):
    """`tapml migrate hf:qwen2 --quantize q4_k --target wgpu:gl` (hidden 256: Q4_K super-blocks for most
    linears, q5_0 for the down projection whose rows of 288 are no whole super-blocks, as llama.cpp falls back) moves every op to
    llvmpipe; a q4_0 tiny llama generates on lavapipe with every quantized linear a packed kernel."""
    vulkan_or_skip()
    state = tmp_path / "s.json"
    r = tapml("migrate", "hf:qwen2", "--quantize", "q4_k", "--hf-config", "hidden_size=256",
              "--hf-config", "intermediate_size=288", "--target", "wgpu:gl", "--state", state)
    assert r.exit_code == 0, r.output
    assert "100.0%" in r.output
    assert {"tapml.q4_k_linear.default", "tapml.q4_k_embedding.default",
            "tapml.q5_0_linear.default"} <= _migrated_quantized_ops(state)
    # the whole model is judged by its logits as distributions too, kept in the state and read back
    doc = json.loads(state.read_text())
    agreement = doc["end_to_end"]["distribution"]
    assert agreement["status"] == "pass" and agreement["positions"] == 16 and agreement["mean_kl"] < 1e-6
    assert agreement["top1_agreement"] == 1.0 and agreement["thresholds"] == {"mean_kl": 1e-3, "top1_agreement": 0.9}
    assert next(u for u in doc["units"] if u["kind"] == "model")["distribution"] == agreement
    assert MigrationState.from_json(doc, strict=True).end_to_end.distribution == agreement
    assert "logits as distributions over 16 positions" in " ".join(r.output.split())
    r = tapml("generate", "zoo:tiny-llama", "--quantize", "q4f16_1", "--target", "wgpu:vulkan", "--tokens", "6",
              "--json", tmp_path / "g.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["placement"]["decode"]["fell_back"] == 0 and doc["summary"]["pass"] == 7
    assert doc["placement"]["decode"]["quantized"] == doc["placement"]["decode"]["quantized_on_target"] == 16
    assert "16/16 decode linears and embeddings ran on the target as packed-weight kernels" in " ".join(r.output.split())
    assert doc["distribution"]["judged"] and doc["distribution"]["status"] == "pass"
    assert doc["distribution"]["mean_kl"] < 1e-9 and doc["upload_bytes_per_decode_step"] <= 64


@pytest.mark.slow
@in_chromium
def test_q4_k_model_migrates_whole_in_chromium(tmp_path):
    """The same quantized qwen2 (hidden 64: every row takes q5_0) migrates whole in headless Chromium."""
    state = tmp_path / "s.json"
    r = tapml("migrate", "hf:qwen2", "--quantize", "q4_k", "--target", "browser", "--state", state)
    assert r.exit_code == 0, r.output
    assert {"tapml.q5_0_linear.default", "tapml.q5_0_embedding.default"} <= _migrated_quantized_ops(state)


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
def test_bench_generation_times_each_scheme_next_to_the_unquantized_model(tmp_path):
    """`tapml bench generation --quantize q4_0,q8_0`: the unquantized run and one per scheme, each with
    its decode tokens/s on lavapipe and in torch, the ratio to the unquantized target run, and what the
    weights take (packed codes and scales a fraction of the float weights)."""
    vulkan_or_skip()
    r = tapml("bench", "generation", "--target", "wgpu:vulkan", "--tokens", "1,3", "--repeat", "1",
              "--quantize", "q4_0,q8_0", "--json", tmp_path / "b.json")
    assert r.exit_code == 0, r.output
    assert "decode by weight format" in r.output
    doc = json.loads((tmp_path / "b.json").read_text())
    runs = {run["quantize"]: run for run in doc["quantized"]}
    assert set(runs) == {"q4_0", "q8_0"} and doc["quantize"] is None
    for run in runs.values():
        assert run["passed"] and run["decode_tokens_per_s"]["target"] > 0 and run["decode_vs_unquantized"] > 0
        assert run["upload_bytes_per_decode_step"] <= 64  # packed weights stay on the device
    float_bytes = doc["weight_bytes"]["float"] + doc["weight_bytes"]["packed"]
    assert runs["q4_0"]["weight_bytes"]["packed"] < runs["q8_0"]["weight_bytes"]["packed"] < float_bytes / 3


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
def test_quantized_generation_over_a_device_server(tmp_path):
    """A real `tapml serve --platform wgpu:vulkan` on loopback runs the packed-weight ops of an 8da4w
    generation (the closed vocabulary takes tapml's own ops; the per-token quantization on its device)."""
    vulkan_or_skip()
    from tapml.remote.launcher import ServerProcess
    token = "quantized-" + "x" * 24
    (tmp_path / "tok").write_text(token)
    srv = ServerProcess(platform="wgpu:vulkan", token=token)
    try:
        r = tapml("generate", "zoo:tiny-llama", "--quantize", "8da4w", "--target", f"remote://{srv.host}:{srv.port}",
                  "--token-file", tmp_path / "tok", "--tokens", "3", "--json", tmp_path / "g.json")
        assert r.exit_code == 0, r.output
        doc = json.loads((tmp_path / "g.json").read_text())
        assert doc["summary"]["pass"] == 4 and doc["placement"]["decode"]["quantized_on_target"] == 15
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_quantized_ops_expand_carves_the_float_chain_in_place_of_each_op(tmp_path):
    """`--quantized-ops expand`: each quantized op's own computation is carved in its place (the
    bytes and nibbles picked with shifts and masks, the scales, the product), every step a case of the
    vocabulary's aten ops, and the model's outputs are the whole ops' bit for bit."""
    from tapml.carving.store import CarveStore
    assert tapml("carve", "zoo:tiny-llama", "--quantize", "q4_0", "-o", tmp_path / "whole").exit_code == 0
    r = tapml("carve", "zoo:tiny-llama", "--quantize", "q4_0", "--quantized-ops", "expand", "-o", tmp_path / "chain")
    assert r.exit_code == 0, r.output
    whole, chain = CarveStore(tmp_path / "whole"), CarveStore(tmp_path / "chain")
    assert chain.quantize == "q4_0" and chain.quantized_ops == "expand" and whole.quantized_ops == "whole"
    ops = {c["op"] for c in chain.cases}
    assert not any(op.startswith("tapml.") for op in ops)
    assert {"aten.bitwise_right_shift.Tensor_Scalar", "aten.bitwise_and.Scalar", "aten.view.dtype"} <= ops
    mine, theirs = whole.model_outputs(), chain.model_outputs()
    assert len(mine) == len(theirs) == 1
    assert torch.equal(next(iter(mine.values())), next(iter(theirs.values())))
    r = tapml("carve", "zoo:tiny-llama", "--quantized-ops", "expand", "-o", tmp_path / "x")
    assert r.exit_code == 2 and "belongs to --quantize" in r.output
    r = tapml("carve", "zoo:tiny-llama", "--quantize", "q4_0", "--quantized-ops", "both", "-o", tmp_path / "x")
    assert r.exit_code == 2 and "choose whole or expand" in r.output


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
def test_nan_from_a_quantized_op_is_a_failing_generation_not_a_crash(tmp_path):
    """A packed linear that writes NaN: every step a mismatch (exit 1), the distribution a failure that
    counts the NaN steps, and the Generation JSON still valid JSON."""
    vulkan_or_skip()
    r = tapml("generate", "zoo:tiny-llama", "--quantize", "q4_0", "--target", "wgpu:vulkan", "--tokens", "2",
              "--inject", "tapml.q4_0_linear.default=nan", "--json", tmp_path / "g.json")
    assert r.exit_code == 1, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["summary"]["mismatch"] == 3 and all(step["kl"] is None for step in doc["steps"])
    assert doc["distribution"]["status"] == "fail" and doc["distribution"]["nonfinite"] == 3
