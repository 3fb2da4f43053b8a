"""Scale: a sized config end to end (slow), and `bench scale --checkpoint`: the checkpoint it writes
(fast) and its report on a small shape on lavapipe (slow).

The sized config: `tapml migrate` of hf:llama at hidden 1024, 4 layers and
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


#: A llama shape small enough for a test; the checkpoint of `bench scale --checkpoint` is 1B-class by default.
SMALL_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 512}


def _tapml(*args, timeout=600):
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TAPML_TOKEN"}
    return subprocess.run([sys.executable, "-m", "tapml.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_scale_checkpoint_is_written_as_users_have_one_and_its_shape_checked(tmp_path):
    """The bench's checkpoint is what save_pretrained writes (bfloat16, sharded safetensors with an
    index) and tapml's own checkpoint loading accepts it; a bad --shape or a misused flag is exit 2."""
    from tapml.bench import SCALE_CHECKPOINT_SHAPE, check_scale_shape, write_scale_checkpoint
    from tapml.errors import TapmlError
    from tapml.frontends.checkpoint import open_checkpoint
    assert SCALE_CHECKPOINT_SHAPE["hidden_size"] == 2048 and SCALE_CHECKPOINT_SHAPE["num_hidden_layers"] == 16 \
        and SCALE_CHECKPOINT_SHAPE["vocab_size"] == 128000
    info = write_scale_checkpoint(tmp_path / "ckpt", SMALL_SHAPE)
    ckpt = open_checkpoint(str(tmp_path / "ckpt"))
    assert ckpt.dtype == "bfloat16" and len(ckpt.weights) == info["shards"] >= 2
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    assert info["checkpoint_bytes"] == sum(w.stat().st_size for w in ckpt.weights) > 2 * info["params"]
    assert ckpt.config["hidden_size"] == 64 and ckpt.config["tie_word_embeddings"] is True
    for bad, says in (({"hidden": 8}, "not a shape key"), ({"vocab_size": 0}, "positive integer"),
                      ({"tie_word_embeddings": 1}, "true or false"), ({"num_attention_heads": 3}, "must divide")):
        with pytest.raises(TapmlError, match=says):
            check_scale_shape(bad)
    r = _tapml("bench", "scale", "--checkpoint", "--hf-config", "vocab_size=8", "--target", "reference")
    assert r.returncode == 2 and "takes num_hidden_layers=N" in r.stderr, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.xdist_group("vulkan")
@pytest.mark.parametrize("target", [pytest.param("wgpu:vulkan", marks=_vulkan())])
def test_bench_scale_checkpoint_measures_load_carve_migrate_and_memory(tmp_path, target, figure):
    """`tapml bench scale --checkpoint` at a small shape, layer-limited: every figure of the report
    is measured (times, peak RSS against the checkpoint's bytes on disk, the store's size)."""
    out, work = tmp_path / "scale.json", tmp_path / "work"
    shape = [a for k, v in SMALL_SHAPE.items() for a in ("--shape", f"{k}={v}")]
    r = _tapml("bench", "scale", "--checkpoint", *shape, "--hf-config", "num_hidden_layers=1", "--target", target,
               "--workdir", str(work), "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    f = json.loads(out.read_text())
    ckpt = f["checkpoint"]
    weights = sorted((work / "checkpoint").glob("*.safetensors"))
    assert ckpt["checkpoint_bytes"] == sum(w.stat().st_size for w in weights) and ckpt["shards"] == len(weights) >= 2
    assert ckpt["shape"]["hidden_size"] == 64 and ckpt["write_s"] > 0 and f["dtype"] == "bfloat16"
    store = json.loads((work / "store" / "manifest.json").read_text())
    assert store["hf_config"] == {"num_hidden_layers": 1} and store["dtype"] == "bfloat16"
    assert 0 < f["load_s"] < f["carve"]["s"] and f["carve_s"] > 0
    assert f["migrate_s"] == pytest.approx(f["migrate"]["s"], abs=1e-3) and f["wall_s"] > f["migrate_s"] > 0
    for child in ("carve", "migrate"):  # from wait4: at least what the child saw of itself
        peak = f[child]["peak_rss_bytes"]
        assert peak >= f[child]["peak_rss_self_bytes"] > 50 << 20
        assert f["peak_rss_vs_checkpoint"][child] == pytest.approx(peak / ckpt["checkpoint_bytes"], rel=1e-3)
    stored = sum(p.stat().st_size for p in (work / "store").rglob("*") if p.is_file())
    assert 0 < f["store_bytes"] <= stored
    assert f["store_vs_checkpoint"] == pytest.approx(f["store_bytes"] / ckpt["checkpoint_bytes"], rel=1e-3)
    assert f["passed"] is True and f["ops_share"] == 1.0 and f["seconds"]["load"] == pytest.approx(f["load_s"], abs=1e-3)
    assert "load, carve, migrate s" in " ".join(r.stdout.split())
    figure("small checkpoint bench scale wall s", f["wall_s"])
