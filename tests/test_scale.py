"""Slow tier: a sized config end to end. `tapml migrate` of hf:llama at hidden 1024, 4 layers and
a 64 000-token vocabulary (its embedding, the LM head and its permute are over lavapipe's
128 MiB storage-binding limit, so they run split across binding windows) exits 0 with every op
and every FLOP on the target; wall time and peak RSS are reported as figures."""

import json
import os
import sys

import pytest

CONFIG = {"hidden_size": 1024, "num_hidden_layers": 4, "intermediate_size": 2816, "vocab_size": 64000}


def _vulkan() -> list:
    try:
        from tapml.platforms.wgpu_native import available_backends
    except ImportError as e:
        return [pytest.mark.skip(reason=f"tapml.platforms.wgpu_native is not importable: {e}")]
    if "vulkan" not in available_backends():
        return [pytest.mark.skip(reason="no Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")]
    return []


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.xdist_group("vulkan")
@pytest.mark.parametrize("target", [pytest.param("wgpu:vulkan", marks=_vulkan())])
def test_sized_llama_migrates_wholly_to_the_target(tmp_path, target, figure):
    from tapml.bench import run_child
    state = tmp_path / "s.json"
    argv = [sys.executable, "-m", "tapml.cli", "migrate", "hf:llama", "--target", target, "--state", str(state), "-q"]
    argv += [a for k, v in CONFIG.items() for a in ("--hf-config", f"{k}={v}")]
    env = {k: v for k, v in os.environ.items() if k != "TAPML_TOKEN"}
    run = run_child(argv, timeout=600, env=env)
    assert run["returncode"] == 0, run
    doc = json.loads(state.read_text())
    placement = doc["placement"]
    assert doc["stage"] == "done" and not doc["culprits"]
    assert placement["ops_share"] == 1.0 and placement["flops_share"] == 1.0, placement
    assert placement["ops_on_target"] == placement["ops_total"] > 100
    params = 2 * CONFIG["vocab_size"] * CONFIG["hidden_size"] * 4  # the embedding and the LM head alone
    figure("sized hf:llama migrate wall s", round(run["s"], 1))
    figure("sized hf:llama migrate peak RSS GiB", round(run["peak_rss_bytes"] / (1 << 30), 2))
    assert run["peak_rss_bytes"] > params  # measured for real: the weights were in memory
