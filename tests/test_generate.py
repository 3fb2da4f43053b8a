"""`tapml generate`: a generation (prefill + decode steps against a static KV cache) checked step by
step on real targets; bad input; the near-tie rule. Device tests run on lavapipe / llvmpipe."""

import json

import pytest

from support import NEEDS_CHROMIUM
import torch
from typer.testing import CliRunner

from tapml.cli import app
from tapml.judging.compare import Tolerances
from tapml.driving.generate import generate, judge_step, passed

runner = CliRunner()
STEP_KEYS = {"step", "kind", "reference_token", "target_token", "max_abs_err", "status", "message", "kl"}
#: A decode step sends its token id and its cache position, nothing else (weights and cache stay).
DECODE_STEP_MAX_BYTES = 64


def tapml(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def gen_store(tmp_path_factory):
    """``gen_store(spec, tokens, prompt_len)`` -> CarveStore of that generation, carved once per module."""
    from tapml.carving import CarveStore
    from tapml.carving.generation import carve_generation
    cache = {}

    def get(spec: str, tokens: int, prompt_len: int) -> CarveStore:
        if (spec, tokens, prompt_len) not in cache:
            out = tmp_path_factory.mktemp("gen") / "store"
            carve_generation(spec, out, tokens=tokens, prompt_len=prompt_len)
            cache[spec, tokens, prompt_len] = CarveStore(out)
        return cache[spec, tokens, prompt_len]

    return get


@pytest.fixture(scope="module")
def llama8(gen_store):
    return gen_store("zoo:tiny-llama", 8, 5)


def _wgpu(backend):
    from tapml.platforms.wgpu_native import available_backends
    if backend not in available_backends():
        pytest.skip(f"no {backend} adapter here (install mesa-vulkan-drivers / mesa for lavapipe and llvmpipe)")
    from tapml.driving.targets import open_target
    return open_target(f"wgpu:{backend}")


def _all_pass(doc: dict, steps: int) -> None:
    assert doc["summary"]["steps"] == steps and len(doc["steps"]) == steps
    assert [r["step"] for r in doc["steps"]] == list(range(steps))
    assert [r["kind"] for r in doc["steps"]] == ["prefill"] + ["decode"] * (steps - 1)
    bad = [r for r in doc["steps"] if r["status"] not in ("pass", "near-tie")]
    assert not bad, bad[:3]
    assert passed(doc) and doc["summary"]["first_failure"] is None and not doc["culprits"]


# --- fast tier: the reference, the near-tie rule, bad input ----------------------------------------

def test_teacher_forced_on_the_reference_follows_the_json_contract(llama8, tmp_path):
    r = tapml("generate", llama8.path, "--target", "reference", "--json", tmp_path / "g.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert {"target", "model", "device", "steps", "summary", "culprits", "programs_compiled",
            "upload_bytes_per_decode_step", "tokens_per_s"} <= set(doc)
    assert set(doc["summary"]) == {"steps", "pass", "mismatch", "near_tie", "error", "first_failure"}
    assert all(set(row) == STEP_KEYS for row in doc["steps"])
    assert all(0 <= row["kl"] < 1e-9 for row in doc["steps"])  # the reference against itself
    assert doc["distribution"]["status"] == "pass" and not doc["distribution"]["judged"] and doc["quantize"] is None
    assert doc["distribution"]["top1_agreement"] == 1.0
    assert doc["model"] == "zoo:tiny-llama" and doc["mode"] == "teacher-forced"
    _all_pass(doc, 9)
    assert [row["reference_token"] for row in doc["steps"]] == [s["token"] for s in llama8.steps]
    assert doc["target_tokens"] == doc["reference_tokens"]
    assert doc["tokens_per_s"]["target"] > 0 and doc["tokens_per_s"]["reference"] > 0
    assert "compiled per shape" in doc["compiled_per_shape"]
    assert doc["kv_cache"]["on_device"] and doc["kv_cache"]["note"] is None and doc["kv_cache"]["bytes"] > 0
    # the terminal: both token streams, a row per step, the summary
    assert "reference:" in r.output and "target:" in r.output and "9/9 steps pass" in r.output
    assert "no tokenizer" in r.output


def test_decode_rates_leave_out_the_first_step_which_compiles():
    """tokens/s is taken over the decode steps after the first (which compiles the decode programs
    and uploads their weights, seconds on lavapipe against milliseconds a step), or the one step."""
    from tapml.driving.generate import _steady_rate
    assert _steady_rate([3.0, 0.1, 0.4]) == 4.0
    assert _steady_rate([0.5]) == 2.0
    assert _steady_rate([]) is None and _steady_rate([1.0, 0.0]) is None


def test_a_prefix_of_the_stored_steps_can_be_checked(llama8):
    from tapml.driving.targets import open_target
    with open_target("reference") as platform:
        doc = generate(llama8, platform, "reference", tokens=3)
    _all_pass(doc, 4)


def test_near_tie_is_reported_not_failed():
    tol = Tolerances()
    expected = torch.tensor([1.0, 1.00001, -3.0])
    swapped = torch.tensor([1.00001, 1.0, -3.0])
    status, comparison, token = judge_step(swapped, expected, tol, reference_token=1)
    assert (status, token) == ("near-tie", 0) and comparison.passed and "top-2 gap" in comparison.message
    status, _, token = judge_step(expected, expected, tol, reference_token=1)
    assert (status, token) == ("pass", 1)
    far = torch.tensor([2.0, 1.0, -3.0])
    status, comparison, _ = judge_step(far, expected, tol, reference_token=1)
    assert status == "mismatch" and not comparison.passed


@pytest.mark.parametrize("args, says", [
    (["zoo:mlp", "--tokens", "2"], "not a causal LM"),
    (["zoo:tiny-llama", "--tokens", "0"], "--tokens 0"),
    (["zoo:tiny-llama", "--tokens", "-3"], "--tokens -3"),
    (["zoo:tiny-llama", "--prompt-len", "0"], "--prompt-len 0"),
    (["hf:gpt2", "--hf-config", "n_positions=16", "--prompt-len", "12", "--tokens", "8"], "exceeds the model's 16"),
    (["zoo:tiny-llama", "--inject", "aten.tanh.default=scale:2"], "no aten.tanh.default"),
    (["hf:bert", "--tokens", "2"], "not a decoder-only causal LM"),
])
def test_bad_input_exits_2_saying_what_fits(args, says):
    r = tapml("generate", *args)
    assert r.exit_code == 2, r.output
    assert says in r.output


def test_a_store_without_a_generation_or_too_few_steps_is_bad_input(carved, llama8):
    r = tapml("generate", carved("zoo:mlp"))
    assert r.exit_code == 2 and "holds no generation" in r.output and "--generate" in r.output
    r = tapml("generate", llama8.path, "--tokens", "9")
    assert r.exit_code == 2 and "holds 8 decode steps" in r.output
    r = tapml("generate", llama8.path, "--prompt-len", "7")
    assert r.exit_code == 2 and "5-token prompt" in r.output


def test_carve_generate_writes_a_generation_store(tmp_path):
    r = tapml("carve", "zoo:tiny-llama", "-o", tmp_path / "S", "--generate", "2", "--prompt-len", "3", "-q")
    assert r.exit_code == 0, r.output
    from tapml.carving import CarveStore
    store = CarveStore(tmp_path / "S")
    assert store.is_generation and len(store.steps) == 3 and store.step_inputs(0)["input_ids"].shape == (1, 3)
    for args, says in ((["--generate", "0"], "1 or more"), (["--generate", "2", "--prompt-len", "0"], "1 or more")):
        r = tapml("carve", "zoo:tiny-llama", "-o", tmp_path / "T", *args)
        assert r.exit_code == 2 and says in r.output
    r = tapml("carve", "zoo:mlp", "-o", tmp_path / "U", "--generate", "2")
    assert r.exit_code == 2 and "not a causal LM" in r.output


def test_hf_config_reaches_migrate_and_session(tmp_path):
    state = tmp_path / "s.json"
    r = tapml("migrate", "hf:gpt2", "--hf-config", "n_layer=1", "--state", state, "-q")
    assert r.exit_code == 0, r.output
    from tapml.carving import CarveStore
    store = CarveStore(tmp_path / "s.store")
    assert store.manifest["hf_config"] == {"n_layer": 1}
    assert not any(".h.1." in n.module for n in store.graph.nodes)
    # the store beside the state was carved with another config: say so, do not reuse it
    r = tapml("migrate", "hf:gpt2", "--state", state, "-q")
    assert r.exit_code == 2 and "--hf-config" in r.output
    r = runner.invoke(app, ["session", "hf:gpt2", "--hf-config", "n_layer=1", "--state", str(state)],
                      input="quit\n")
    assert r.exit_code == 0, r.output


# --- device tier -----------------------------------------------------------------------------------

@pytest.mark.device
@pytest.mark.slow
def test_done_when_32_tokens_on_vulkan(tmp_path):
    _wgpu("vulkan")
    r = tapml("generate", "zoo:tiny-llama", "--target", "wgpu:vulkan", "--tokens", "32", "--store", tmp_path / "S",
              "--json", tmp_path / "g.json", "-q")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    _all_pass(doc, 33)
    assert doc["placement"]["decode"]["fell_back"] == 0 and doc["placement"]["prefill"]["fell_back"] == 0
    # weights and the cache stay on the device: a decode step uploads its token id and position only
    assert 0 < doc["upload_bytes_per_decode_step"] <= DECODE_STEP_MAX_BYTES
    assert doc["upload_bytes_first_decode_step"] > 100_000  # the decode program's weights, once
    assert doc["programs_compiled"] == 2
    assert doc["tokens_per_s"]["target"] > 0 and doc["tokens_per_s"]["reference"] > 0
    assert (tmp_path / "S" / "manifest.json").is_file()  # --store keeps the carved store


@pytest.mark.device
@pytest.mark.slow
def test_programs_compiled_is_flat_in_tokens_and_prompt_length(gen_store, llama8):
    with _wgpu("vulkan") as platform:
        counts = {}
        for tokens, prompt_len in ((8, 5), (32, 5), (8, 24)):
            store = llama8 if (tokens, prompt_len) == (8, 5) else gen_store("zoo:tiny-llama", tokens, prompt_len)
            doc = generate(store, platform, "wgpu:vulkan", localize=False)
            _all_pass(doc, tokens + 1)
            counts[tokens, prompt_len] = doc["programs_compiled"]
    assert counts[8, 5] == counts[32, 5] == counts[8, 24] == 2


@pytest.mark.device
def test_injected_fault_is_found_at_its_step_with_its_culprit(llama8, tmp_path):
    _wgpu("vulkan")
    r = tapml("generate", llama8.path, "--target", "wgpu:vulkan", "--tokens", "2", "--inject",
              "aten.rsqrt.default=scale:1.01", "--json", tmp_path / "g.json")
    assert r.exit_code == 1, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["summary"]["first_failure"] == 0 and doc["steps"][0]["status"] == "mismatch"
    culprit = doc["culprits"][0]
    assert culprit["op"] == "aten.rsqrt.default" and culprit["step"] == 0
    assert culprit["node"].startswith("rsqrt") and culprit["module"].endswith("layernorm")
    assert {"op", "node", "module", "kind", "step", "max_abs_err"} <= set(culprit)
    assert "culprits of step 0" in r.output and "aten.rsqrt.default" in r.output


@pytest.mark.device
def test_a_decode_step_with_nodes_on_the_reference_keeps_every_layers_cache(llama8, monkeypatch):
    """With some nodes of every layer on the reference, each layer's regions compile to one program that
    runs once per layer in a step: the cache a layer left on the device is read back before the next
    layer's run of that program overwrites it (it used to make the step an error: a stale resident
    tensor), so every step still passes."""
    from tapml.driving.generate import generate
    with _wgpu("vulkan") as platform:
        supports = platform.supports
        monkeypatch.setattr(platform, "supports", lambda node: "kept on the reference by this test"
                            if node.op == "aten.mul.Tensor" else supports(node))
        doc = generate(llama8, platform, "wgpu:vulkan", tokens=4, localize=False)
    assert doc["placement"]["decode"]["fell_back"] > 2 and doc["placement"]["decode"]["on_target"] > 0
    _all_pass(doc, 5)


@pytest.mark.device
def test_free_generation_on_gl_follows_the_reference(llama8):
    with _wgpu("gl") as platform:
        doc = generate(llama8, platform, "wgpu:gl", tokens=3, free=True)
    _all_pass(doc, 4)
    assert doc["mode"] == "free" and doc["first_divergence"] is None
    assert doc["target_tokens"] == doc["reference_tokens"][:4]
    assert 0 < doc["upload_bytes_per_decode_step"] <= DECODE_STEP_MAX_BYTES


@pytest.mark.device
def test_free_generation_reports_where_a_faulty_target_diverges(llama8):
    from tapml.platforms.wgpu_native import available_backends
    if "vulkan" not in available_backends():
        pytest.skip("no vulkan adapter here")
    from tapml.driving.targets import open_target
    with open_target("wgpu:vulkan", inject=["aten.mm.default=offset:0.5"]) as platform:
        doc = generate(llama8, platform, "wgpu:vulkan", free=True, localize=False)
    assert not passed(doc) and doc["summary"]["first_failure"] == 0
    assert doc["first_divergence"] is not None
    k = doc["first_divergence"]
    assert doc["target_tokens"][k] != doc["reference_tokens"][k]
    assert doc["target_tokens"][:k] == doc["reference_tokens"][:k]


@pytest.mark.device
def test_generation_through_a_loopback_server(llama8):
    from tapml.platforms.wgpu_native import available_backends
    from tapml.remote.launcher import ServerProcess
    from tapml.driving.targets import open_target
    if "vulkan" not in available_backends():
        pytest.skip("no vulkan adapter here (install mesa-vulkan-drivers for lavapipe)")
    with ServerProcess(platform="wgpu:vulkan", token="t0ken") as srv:
        target = f"remote://{srv.host}:{srv.port}"
        with open_target(target, token="t0ken") as platform:
            doc = generate(llama8, platform, target, tokens=2)
    _all_pass(doc, 3)
    assert 0 < doc["upload_bytes_per_decode_step"] <= DECODE_STEP_MAX_BYTES


@pytest.mark.browser
@NEEDS_CHROMIUM
def test_generation_in_headless_chromium(llama8):
    from tapml.driving.targets import open_target
    with open_target("browser") as platform:
        doc = generate(llama8, platform, "browser", tokens=2)
    _all_pass(doc, 3)
    assert 0 < doc["upload_bytes_per_decode_step"] <= DECODE_STEP_MAX_BYTES


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.parametrize("spec", ["hf:gpt2", "hf:gpt_neox", "hf:qwen2"])
def test_other_decoders_generate_through_hf(gen_store, spec):
    store = gen_store(spec, 2, 4)
    with _wgpu("vulkan") as platform:
        doc = generate(store, platform, "wgpu:vulkan")
    _all_pass(doc, 3)
    assert doc["model"] == spec
