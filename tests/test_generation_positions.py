"""Generation for architectures that compute positions from data (issue #31, item 4).

OPT derives its positions from the static cache's length: in transformers' export recipe that is a
data-dependent scalar (``aten._local_scalar_dense``) sizing a tensor differently at every step.
``export_generation_programs`` exports such a model again with ``position_ids`` passed in from
``cache_position``, as ``generate`` passes them; the scalar export still asserts on (read by
runtime checks only) is dropped by ``graph_from_fx`` (``checked_only``)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tapml.cli import app
from tapml.graph import checked_only, graph_from_fx, needs_real_values

runner = CliRunner()


class _CheckedItem(torch.nn.Module):
    """Reads a scalar of its input that only a runtime check uses (as OPT's leftover cache length)."""

    def forward(self, x, n):
        torch._check(n[0].item() >= 0)
        return x * 2


class _SizedByItem(torch.nn.Module):
    """Sizes a tensor by a scalar of its input: a data-dependent shape that needs real values."""

    def forward(self, x, n):
        return x[: n[0].item()] * 2


def _export(module, *args):
    from tapml.capture import export
    return export(torch.export.export(module, args, strict=False), ())


def test_a_scalar_only_checks_read_is_dropped_and_one_that_sizes_a_tensor_is_named():
    ep = _export(_CheckedItem(), torch.randn(3), torch.tensor([2]))
    dropped = {str(n.target) for n in checked_only(ep.graph)}
    assert "aten._local_scalar_dense.default" in dropped
    assert not needs_real_values(ep.graph)
    graph = graph_from_fx(ep.graph, ep.graph_signature)  # no reference values needed
    assert [n.op for n in graph.nodes] == ["aten.mul.Tensor"]
    assert [name for name, _ in graph.inputs] == ["x", "n"]

    ep = _export(_SizedByItem(), torch.randn(3), torch.tensor([2]))
    assert "aten._local_scalar_dense.default" not in {str(n.target) for n in checked_only(ep.graph)}
    assert needs_real_values(ep.graph)
    with pytest.raises(ValueError, match=r"node _local_scalar_dense \(aten._local_scalar_dense.default\) has a "
                                         "data-dependent shape or value"):
        graph_from_fx(ep.graph, ep.graph_signature)


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
    from tapml.models import load_causal_lm, parse_hf_overrides
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
