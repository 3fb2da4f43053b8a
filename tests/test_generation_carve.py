"""Carving a generation (prefill + greedy decode steps with a static KV cache): fast tier, no device."""

import json
import shutil

import pytest
import torch

from tapml.carving import CarveStore
from tapml.carving.generation import carve_generation
from tapml.errors import TapmlError
from tapml.graph import Graph, step
from tapml.frontends.models import load_causal_lm

PROMPT_LEN = 5


@pytest.fixture(scope="module")
def carve_once(tmp_path_factory):
    """``carve_once(spec, tokens)`` -> CarveStore of that generation, carved once per module."""
    cache = {}

    def get(spec: str, tokens: int) -> CarveStore:
        if (spec, tokens) not in cache:
            out = tmp_path_factory.mktemp("gen") / "store"
            info = carve_generation(spec, out, tokens=tokens, prompt_len=PROMPT_LEN)
            assert info["steps"] == tokens + 1 and info["cases"] > 0
            cache[spec, tokens] = CarveStore(out)
        return cache[spec, tokens]

    return get


@pytest.fixture(scope="module")
def llama4(carve_once):
    return carve_once("zoo:tiny-llama", 4)


def _logits_ref(graph: Graph) -> str:
    (ref,) = [r for r in graph.outputs if r not in graph.state.values()]
    return ref


def test_steps_are_recorded_and_tokens_match_transformers_generate(llama4):
    store = llama4
    assert store.is_generation
    gen = store.manifest["generation"]
    assert (gen["prompt_len"], gen["tokens"], gen["max_cache_len"]) == (PROMPT_LEN, 4, PROMPT_LEN + 4)
    assert [(s["step"], s["kind"]) for s in store.steps] == [(0, "prefill")] + [(k, "decode") for k in range(1, 5)]
    prompt = store.step_inputs(0)["input_ids"]
    assert prompt.shape == (1, PROMPT_LEN)
    # Teacher truth: transformers' own greedy generate (its default dynamic cache) on the same weights.
    model = load_causal_lm("zoo:tiny-llama", tokens=4, prompt_len=PROMPT_LEN)
    model.generation_config.cache_implementation = None
    with torch.no_grad():
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                                  pad_token_id=0)
    assert store.reference_tokens == expected[0, PROMPT_LEN:].tolist()
    vocab = model.config.vocab_size
    for s in store.steps:
        logits = store.step_logits(s["step"])
        assert logits.shape == (vocab,) and int(logits.argmax()) == s["token"]
    # Each decode step feeds the previous step's token at the next cache position.
    for k in range(1, 5):
        inputs = store.step_inputs(k)
        assert inputs["input_ids"].tolist() == [[store.steps[k - 1]["token"]]]
        assert inputs["cache_position"].tolist() == [PROMPT_LEN + k - 1]


def test_stored_graphs_replay_the_generation_through_their_state(llama4):
    store = llama4
    prefill, decode = store.step_graph("prefill"), store.step_graph("decode")
    assert prefill.state and set(prefill.state) == set(decode.state)
    assert any(n.op == "aten.index_put.default" for n in decode.nodes)  # the cache update
    params = store.program_inputs()
    cache = {name: params[name] for name in prefill.state}
    outputs, cache = step(prefill, {**params, **store.step_inputs(0)}, cache)
    assert torch.equal(outputs[_logits_ref(prefill)][0, -1], store.step_logits(0))
    decode_params = store.program_inputs("decode")
    # Parameters shared by both programs are stored once.
    shared = {store.manifest["program_inputs"][n]["tensor"] for n in prefill.state} & {
        e["tensor"] for e in store.manifest["generation"]["decode"]["program_inputs"].values()}
    assert shared
    for k in range(1, 5):
        outputs, cache = step(decode, {**decode_params, **store.step_inputs(k)}, cache)
        assert torch.allclose(outputs[_logits_ref(decode)][0, -1], store.step_logits(k), atol=1e-5)
        assert int(outputs[_logits_ref(decode)][0, -1].argmax()) == store.steps[k]["token"]


def test_cases_are_deduplicated_across_steps_and_tagged(llama4, carve_once):
    short = carve_once("zoo:tiny-llama", 2)
    assert len(llama4.cases) == len(short.cases)
    assert sum(c["instances"] for c in llama4.cases) > sum(c["instances"] for c in short.cases)
    prefill, decode = llama4.step_graph("prefill"), llama4.step_graph("decode")
    assert sum(c["instances"] for c in llama4.cases) == len(prefill.nodes) + 4 * len(decode.nodes)
    names = {"prefill": {n.name for n in prefill.nodes}, "decode": {n.name for n in decode.nodes}}
    keys = set()
    for c in llama4.cases:
        assert c["graph"] in ("prefill", "decode") and c["node"] in names[c["graph"]]
        assert c["steps"] == sorted(set(c["steps"])) and c["steps"]
        if c["graph"] == "decode":
            assert c["steps"] == [1, 2, 3, 4] and c["instances"] >= 4
        metas = tuple((tuple(llama4.tensor_index[n]["shape"]), llama4.tensor_index[n]["dtype"]) for n in c["inputs"])
        key = (c["op"], metas, json.dumps(c["args"]), json.dumps(c["kwargs"], sort_keys=True))
        assert key not in keys
        keys.add(key)
    assert {c["graph"] for c in llama4.cases} == {"prefill", "decode"}
    assert all(n.case for n in decode.nodes)


def test_every_case_replays_on_the_reference(llama4):
    from tapml.driving.replay import replay
    from tapml.driving.targets import open_target
    platform = open_target("reference")
    decode_case = next(c for c in llama4.cases if c["graph"] == "decode")
    assert llama4.case_graph(decode_case).nodes[0].name == decode_case["node"]
    doc = replay(llama4, platform, "reference")
    assert doc["summary"]["pass"] == len(llama4.cases) and len(doc["cases"]) == len(llama4.cases)


def test_state_round_trips_and_is_validated(llama4):
    decode = llama4.step_graph("decode")
    again = Graph.from_json(json.loads(json.dumps(decode.to_json())))
    assert again.state == decode.state and again.state
    assert "state" not in llama4.graph.to_json()  # written only when there is one
    name, ref = next(iter(decode.state.items()))
    bad = decode.to_json()
    bad["state"] = {name: "nowhere"}
    with pytest.raises(ValueError, match="no graph output"):
        Graph.from_json(bad)
    bad["state"] = {"nobody": ref}
    with pytest.raises(ValueError, match="no graph input"):
        Graph.from_json(bad)
    logits = _logits_ref(decode)
    bad["state"] = {name: logits}  # another shape than the cache buffer
    with pytest.raises(ValueError, match="shape and dtype"):
        Graph.from_json(bad)


@pytest.mark.parametrize("edit,match", [
    (lambda g: g["steps"][2].__setitem__("token", 10 ** 6), "token"),
    (lambda g: g["steps"].pop(), "steps"),
    (lambda g: g["steps"][1]["inputs"].__setitem__("b_key_cache_0", "step1.input_ids"), "per-step inputs"),
    (lambda g: g["reference_tokens"].reverse(), "reference_tokens"),
    (lambda g: g["decode"]["state"].popitem(), "same state inputs"),
    (lambda g: g["prefill_state"].__setitem__(next(iter(g["prefill_state"])), "missing"), "prefill_state"),
    (lambda g: g["decode"]["program_inputs"].popitem(), "decode.program_inputs"),
    (lambda g: g.__setitem__("tokens", True), "tokens"),
])
def test_a_tampered_generation_is_refused(llama4, tmp_path, edit, match):
    copy = tmp_path / "store"
    shutil.copytree(llama4.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest["generation"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TapmlError, match=match):
        CarveStore(copy)


def test_case_tags_are_validated(llama4, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(llama4.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["cases"][0]["steps"] = [7]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TapmlError, match="step indices"):
        CarveStore(copy)
    del manifest["generation"]
    manifest["cases"][0]["steps"] = [0]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TapmlError, match="generation store"):
        CarveStore(copy)


@pytest.mark.parametrize("spec", ["hf:gpt2", "hf:gpt_neox"])
def test_other_architectures_carve_a_generation(carve_once, spec):
    store = carve_once(spec, 2)
    assert len(store.steps) == 3 and len(store.reference_tokens) == 2
    assert {c["graph"] for c in store.cases} == {"prefill", "decode"}
    assert any(c["op"] == "aten.index_put.default" and c["graph"] == "decode" for c in store.cases)


@pytest.mark.parametrize("spec,kwargs,match", [
    ("zoo:mlp", {}, "zoo:mlp is not a causal LM.*zoo:tiny-llama"),
    ("hf:bert", {}, "not a decoder-only causal LM.*hf:llama"),
    ("model.py:factory", {}, "a causal LM fits"),
    ("zoo:tiny-llama", {"tokens": 0}, "tokens must be an integer of at least 1"),
    ("zoo:tiny-llama", {"prompt_len": 0}, "prompt_len must be an integer of at least 1"),
    ("zoo:tiny-llama", {"prompt_len": 100, "tokens": 40}, "exceeds the model's 128 positions; ask for at most 28"),
])
def test_bad_input_says_what_fits(tmp_path, spec, kwargs, match):
    kwargs = {"tokens": 2, **kwargs}
    with pytest.raises(TapmlError, match=match):
        carve_generation(spec, tmp_path / "store", **kwargs)
    assert not (tmp_path / "store").exists()
