"""Generation for architectures that compute positions from data (issue #31, item 4).

OPT derives its positions from the static cache's length: in transformers' export recipe that is a
data-dependent scalar (``aten._local_scalar_dense``) sizing a tensor differently at every step (XGLM's
``arange`` from it does not even export; BioGPT sizes its mask by it). ``export_generation_programs``
exports such a model again with ``position_ids`` and the mask passed in, as ``generate`` passes them."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tapml.cli import app

runner = CliRunner()


def test_positions_passed_in_are_the_models_own_and_export_without_data_dependent_values():
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from tapml.carving.generation import _positions_as_inputs
    from tapml.graph import needs_real_values
    from tapml.frontends.models import load_causal_lm
    model = load_causal_lm("hf:opt", tokens=2, prompt_len=3, hf_config={"num_hidden_layers": 1})
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=5, device=torch.device("cpu"))
    module = _positions_as_inputs(recipe.model, 5)
    with torch.no_grad():
        decode = torch.export.export(module, (), {"input_ids": torch.zeros(1, 1, dtype=torch.long),
                                                  "cache_position": torch.tensor([3])}, strict=True)
        assert not needs_real_values(decode.graph)
        assert decode.graph_signature.user_inputs == ("input_ids", "cache_position")
        # run as a generation does: prefill, then one token at a time against the static cache
        ids = torch.tensor([[5, 17, 42, 9, 200]])
        steps = [module(input_ids=ids[:, :3], cache_position=torch.arange(3))[0, -1]]
        steps += [module(input_ids=ids[:, k:k + 1], cache_position=torch.tensor([k]))[0, -1] for k in (3, 4)]
        whole = model(input_ids=ids, use_cache=False).logits[0]
    for k, logits in enumerate(steps):
        torch.testing.assert_close(logits, whole[2 + k], rtol=1e-4, atol=1e-5)


def _generates_on_vulkan_at_its_own_positions(tmp_path, spec: str, tokens: int, *hf_config: str) -> None:
    """``tapml generate SPEC --tokens N --target wgpu:vulkan`` exits 0 with every step checked and
    passing, and every step's reference logits are those of the model's own forward (no cache) over
    the whole sequence so far: the positions the programs take from ``cache_position`` are right."""
    from support import vulkan_or_skip
    vulkan_or_skip()
    config = [a for kv in hf_config for a in ("--hf-config", kv)]
    r = runner.invoke(app, ["generate", spec, "--tokens", str(tokens), "--target", "wgpu:vulkan", *config,
                            "--store", str(tmp_path / "S"), "--json", str(tmp_path / "g.json"), "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert [s["kind"] for s in doc["steps"]] == ["prefill"] + ["decode"] * tokens
    assert [s["status"] for s in doc["steps"]] == ["pass"] * (tokens + 1)
    assert doc["summary"]["pass"] == tokens + 1 and doc["summary"]["first_failure"] is None
    assert doc["placement"]["decode"]["fell_back"] == 0 and doc["placement"]["prefill"]["fell_back"] == 0

    from tapml.carving import CarveStore
    from tapml.frontends.models import load_causal_lm, parse_hf_overrides
    store = CarveStore(tmp_path / "S")
    gen = store.manifest["generation"]
    decode = store.step_graph("decode")
    assert [name for name, _ in decode.inputs if name in ("input_ids", "cache_position")] == \
        ["input_ids", "cache_position"]
    assert not any(n.op == "aten._local_scalar_dense.default" for n in decode.nodes)
    model = load_causal_lm(spec, tokens=tokens, prompt_len=gen["prompt_len"],
                           hf_config=parse_hf_overrides(list(hf_config)) or None)
    ids = torch.cat([store.step_inputs(0)["input_ids"], torch.tensor([gen["reference_tokens"]])], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0]
    for k in range(tokens + 1):
        torch.testing.assert_close(store.step_logits(k), logits[gen["prompt_len"] - 1 + k], rtol=1e-4, atol=1e-5)


@pytest.mark.device
@pytest.mark.slow
def test_opt_generates_8_tokens_on_vulkan(tmp_path):
    _generates_on_vulkan_at_its_own_positions(tmp_path, "hf:opt", 8)


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.parametrize("spec", ["hf:xglm", "hf:biogpt"])
def test_other_architectures_that_derived_positions_from_data_generate(tmp_path, spec):
    """XGLM (positions from an ``arange`` over the cache's length) and BioGPT (its mask sized by it)
    exited 2 before, as OPT did; one layer keeps them quick."""
    layers = "num_layers=1" if spec == "hf:xglm" else "num_hidden_layers=1"
    _generates_on_vulkan_at_its_own_positions(tmp_path, spec, 2, layers)


@pytest.mark.slow
def test_a_model_neither_route_exports_is_refused_naming_the_line_of_its_code(tmp_path):
    """MPT slices its ALiBi bias by the cache's length inside attention and takes no position_ids:
    bad input (exit 2) naming the model and the line of its code export stopped at; nothing written."""
    from tapml.carving.generation import carve_generation
    from tapml.errors import TapmlError
    with pytest.raises(TapmlError, match=r"hf:mpt does not export with a static key/value cache .*"
                                         r"\(at transformers/models/mpt/modeling_mpt\.py:\d+: position_bias ="):
        carve_generation("hf:mpt", tmp_path / "S", tokens=2, prompt_len=3, hf_config={"n_layers": 1})
    assert not (tmp_path / "S").exists()
