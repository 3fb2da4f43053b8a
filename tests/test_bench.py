"""`tapml bench`: one smoke run of the whole suite (figures present, kernels correct; speed is
never asserted), the generation figure on lavapipe, `--hf-config` reaching the migrated model,
the remote transport figures on a real loopback server, and bad usage."""

import json
import os
import subprocess
import sys

import pytest

RATIO_KEYS = ("matmul_512_vs_torch", "matmul_1024_vs_torch", "e2e_tiny_llama_vs_torch", "e2e_tiny_vit_vs_torch",
              "carve_write_vs_file_write", "generation_decode_vs_torch", "generation_prefill_vs_torch", "migrate_s")


def tapml(*args, env=None, timeout=300):
    full_env = {k: v for k, v in os.environ.items() if k != "TAPML_TOKEN"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "tapml.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def _bench_target() -> tuple[str, list]:
    try:
        from tapml.platforms.wgpu_native import available_backends
    except ImportError as e:
        return "reference", [pytest.mark.skip(reason=f"tapml.platforms.wgpu_native is not importable: {e}")]
    if "vulkan" not in available_backends():
        return "reference", [pytest.mark.skip(reason="no Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")]
    return "wgpu:vulkan", []


TARGET, _SKIP = _bench_target()


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.xdist_group("vulkan")
@pytest.mark.parametrize("target", [pytest.param(TARGET, marks=_SKIP)])
def test_quick_suite_reports_every_figure(tmp_path, target, figure):
    out = tmp_path / "b.json"
    r = tapml("bench", "--quick", "--target", target, "--json", str(out),
              env={"TAPML_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "160"})
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "mm 512" in r.stdout and "carve writer" in r.stdout and "decode tokens/s" in r.stdout

    ratios = report["ratios"]
    for key in RATIO_KEYS:
        assert key in ratios, key
    for key in RATIO_KEYS[:-1]:
        assert isinstance(ratios[key], float) and ratios[key] > 0, (key, ratios[key])
    assert set(ratios["migrate_s"]) == {"zoo:mlp"} and ratios["migrate_s"]["zoo:mlp"] > 0
    assert set(report["goals"]) >= {"matmul_512_vs_torch", "e2e_tiny_llama_vs_torch", "carve_write_vs_file_write"}

    # every kernel measured was right, or its speed would mean nothing
    sizes = {(m["op"], m["n"]) for m in report["matmul"]}
    assert sizes == {(op, n) for op in ("mm", "bmm") for n in (256, 512, 1024)}
    for m in report["matmul"]:
        assert "error" not in m, m
        assert m["max_abs_err"] < 1e-3 * m["n"], m
        assert m["timing"] == "device"
    from tapml.bench import LONG_ROW_CASES
    assert [r["case"] for r in report["long_rows"]] == list(LONG_ROW_CASES)
    for r in report["long_rows"]:
        assert "error" not in r and r["matches_torch"] is True and r["kernels"] > 1, r
        assert ratios[f"{r['case']}_vs_torch"] > 0
    for spec in ("zoo:tiny-llama", "zoo:tiny-vit"):
        e2e = report["e2e"][spec]
        assert "error" not in e2e, e2e
        assert e2e["max_abs_err"] < 1e-3 and e2e["regions"] == 1 and e2e["ours_ms"] > 0 and e2e["torch_ms"] > 0
        carve = report["carving"]["models"][spec]
        assert carve["export_s"] > 0 and carve["carve_s"] > 0 and carve["bytes"] > 0
    assert report["migrate"]["zoo:mlp"]["passed"] is True
    gen = report["generation"]
    assert "error" not in gen, gen
    assert gen["passed"] and gen["compile_count_flat"] and gen["programs_compiled"]["2"] == gen["programs_compiled"]["8"]
    d = report["dispatch"]
    assert d["empty_kernel_ms"] > 0 and d["per_region_ms"] > 0 and d["regions"] == d["chain"] // 2
    w = report["carving"]["write"]
    assert w["bytes"] >= 16 << 20 and w["file_write_MBps"] > 0 and w["carve_write_MBps"] > 0

    tune = report["autotune"]
    assert tune and tune["tiles"] and (tmp_path / "cache" / "matmul-tiles.json").is_file()
    assert report["transport"] is None
    figure("bench quick wall s", report["wall_s"])
    for key in RATIO_KEYS[:-1]:
        figure(f"bench {key}", ratios[key])


GENERATION_KEYS = {"model", "prompt_len", "tokens", "runs", "statistic", "passed", "summary", "programs_compiled",
                   "compile_count_flat", "upload_bytes_per_decode_step", "decode_tokens_per_s", "prefill_ms", "ratios",
                   "load_avg", "load_avg_median", "tokens_match", "torch_max_abs_err", "torch_threads",
                   "torch_by_threads"}


@pytest.mark.device
@pytest.mark.xdist_group("vulkan")
@pytest.mark.parametrize("target", [pytest.param(TARGET, marks=_SKIP)])
def test_generation_figure_against_torch_eager_decoding(tmp_path, target, figure):
    """A zoo:tiny-llama generation on lavapipe next to torch eager decoding of the same steps:
    both right, both timed, and the programs compiled do not grow from 2 to 8 tokens."""
    from tapml.bench import generation_figure, ratios
    from tapml.driving.targets import open_target
    with open_target(target) as platform:
        g = generation_figure(platform, target, tmp_path / "store", "zoo:tiny-llama", tokens=(2, 8), prompt_len=5,
                              repeat=2)
    assert "error" not in g, g
    assert GENERATION_KEYS <= set(g)
    assert g["tokens"] == 8 and g["prompt_len"] == 5 and g["runs"] == 2 and len(g["load_avg"]) == 2
    assert g["passed"] and g["summary"]["steps"] == 9 and g["summary"]["pass"] + g["summary"]["near_tie"] == 9
    # static shapes: one program per region of each graph, whatever the number of tokens
    assert g["programs_compiled"]["2"] == g["programs_compiled"]["8"] > 0 and g["compile_count_flat"] is True
    assert g["timed_programs_compiled"] == g["programs_compiled"]["8"]
    # weights and the cache stay on the device: a decode step uploads its token id and position only
    assert 0 < g["upload_bytes_per_decode_step"] <= 64 and g["timed_upload_bytes_per_decode_step"] <= 64
    # torch eager is the same model: the reference's tokens and logits
    assert "target" in g["tokens_match"] and all(g["tokens_match"].values()) and g["torch_max_abs_err"] < 1e-4
    assert set(g["torch_by_threads"]) >= {"1"} and str(g["torch_threads"]["decode"]) in g["torch_by_threads"]
    for side in ("target", "torch"):
        assert g["decode_tokens_per_s"][side] > 0 and g["prefill_ms"][side] > 0
    assert g["ratios"]["decode"] == pytest.approx(g["decode_tokens_per_s"]["target"] / g["decode_tokens_per_s"]["torch"],
                                                  rel=1e-2)
    r = ratios({"generation": g})
    assert r["generation_decode_vs_torch"] > 0 and r["generation_prefill_vs_torch"] > 0
    figure("generation decode tokens/s vs torch", r["generation_decode_vs_torch"])


def test_hf_config_reaches_the_migrated_model(tmp_path):
    """`--model hf:... --hf-config K=V`: the migrate run carves the model with the override."""
    from tapml.bench import migrate_figure
    m = migrate_figure("hf:gpt2", "reference", tmp_path, hf_config={"n_layer": 1, "activation_function": "relu"})
    assert m["passed"] is True, m
    manifest = json.loads((tmp_path / "state.store" / "manifest.json").read_text())
    assert manifest["model"] == "hf:gpt2"
    assert manifest["hf_config"] == {"n_layer": 1, "activation_function": "relu"}


def test_transport_figures_of_a_remote_target():
    """A real `tapml serve` on loopback: the suite's transport figures and their ratios."""
    from tapml.bench import ratios, transport_figure
    from tapml.remote.client import RemotePlatform
    from tapml.remote.launcher import ServerProcess
    with ServerProcess(platform="reference", token="t0ken", args=("--max-message-mib", "64")) as srv:
        with RemotePlatform(srv.host, srv.port, token="t0ken") as platform:
            t = transport_figure(platform, quick=True)
    assert t["size_bytes"] == 16 << 20
    r = ratios({"transport": t})
    for key in ("upload_vs_socket", "download_vs_socket", "empty_call_ms"):
        assert isinstance(r[key], float) and r[key] > 0


def test_kernel_figure_on_reference_and_its_ratio():
    """The same figure functions work on any platform; without ``benchmark`` the round trip is timed."""
    from tapml.bench import matmul_figure
    from tapml.platforms.reference import ReferencePlatform
    row = matmul_figure(ReferencePlatform(), 64, batch=2, repeat=1)
    assert row["op"] == "bmm" and row["timing"] == "round trip" and row["max_abs_err"] == 0.0
    assert row["ratio"] == pytest.approx(row["ours_gflops"] / row["torch_gflops"], rel=1e-2)


@pytest.mark.device
@pytest.mark.xdist_group("vulkan")
@pytest.mark.parametrize("target", [pytest.param(TARGET, marks=_SKIP)])
def test_decode_step_rows_by_context_and_cache(tmp_path, target):
    """`bench generation --context`'s rows: one checked generation per cache size, a row per context
    that fits it, each with the target's and torch's step and the kernels per step."""
    from tapml.bench import CONTEXT_STEPS, context_figure
    from tapml.driving.targets import open_target
    with open_target(target) as platform:
        rows = context_figure(platform, target, tmp_path, "zoo:tiny-llama", contexts=[2, 40, 100], caches=[48, 128],
                              repeat=2)
    assert [(r["cache"], r["context"]) for r in rows] == [(48, 2), (128, 2), (128, 40), (128, 100)], rows
    for r in rows:
        assert "error" not in r and r["passed"] and r["model"] == "zoo:tiny-llama"
        assert r["context"] + CONTEXT_STEPS < r["cache"]
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(1e3 / r["step_ms"], rel=1e-2)
        assert r["torch_tokens_per_s"] > 0 and r["torch_threads"] in (1, 2) and len(r["load_avg"]) == 2
        # the decode program is one region: the key/value puts and attention run as their fused kernels
        assert r["programs_compiled"] == 1 and r["kernels_per_step"] > 0
    from tapml.carving.store import CarveStore
    from tapml.platforms.wgsl import compile_graph
    graph = CarveStore(tmp_path / "cache128").step_graph("decode")
    with open_target(target) as platform:
        kernels = compile_graph(graph, platform.caps()).kernels
    from tests.support import attention_kernels
    bodies = [part for k in kernels for part in k.name.split("+")]  # merged dispatches name every body
    assert len(attention_kernels(bodies)) == 2 and sum(n.startswith("put_in_place") for n in bodies) == 4
    assert rows[1]["kernels_per_step"] == len(kernels)


@pytest.mark.parametrize("args, message", [
    (("--target", "tpu"), "unknown target"),
    (("--model", "zoo:nope"), "unknown zoo model"),
    (("--model", "llama"), "not a MODEL spec"),
    (("--model", "no/such/file.py:factory"), "does not exist"),
    (("--hf-config", "n_layer=1"), "applies to hf:MODEL_TYPE models"),
    (("--model", "hf:gpt2", "--hf-config", "n_layer"), "KEY=VALUE"),
    (("--generation-model", "zoo:tiny-bert"), "not a causal LM"),
    (("--generation-model", "zoo:tiny-llama", "--hf-config", "n_layer=1"), "applies to hf:MODEL_TYPE models"),
    (("generation", "--tokens", "8,2"), "FEW < MANY"),
    (("generation", "--model", "zoo:mlp"), "causal LM"),
    (("--json", "/no/such/dir/b.json"), "does not exist"),
    (("generation", "--context", "16,x"), "whole numbers"),
    (("generation", "--cache", "256"), "add --context"),
    (("generation", "--context", "300", "--cache", "256"), "no --context fits it"),
])
def test_bad_usage_exits_2(args, message):
    r = tapml("bench", *args, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr


def test_transport_subcommand_is_still_there():
    r = tapml("bench", "transport", "--help", timeout=60)
    assert r.returncode == 0 and "--size-mib" in r.stdout


def test_scale_figure_splits_a_migration_by_kind_of_work(tmp_path):
    """`tapml bench scale` on a real (small) model: carve and migrate each in a fresh process,
    their wall time split into export, carving, compilation, device execution, comparison,
    reference runs and the rest (shares of the whole), peak RSS measured from outside."""
    out = tmp_path / "scale.json"
    r = tapml("bench", "scale", "--model", "zoo:mlp", "--target", "reference", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    f = json.loads(out.read_text())
    from tapml.bench import SCALE_SHARES
    assert set(f["shares"]) == set(SCALE_SHARES) == set(f["seconds"])
    assert sum(f["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    assert f["seconds"]["export"] > 0 and f["seconds"]["compare"] > 0 and f["seconds"]["device"] > 0
    assert f["wall_s"] == pytest.approx(f["carve"]["s"] + f["migrate"]["s"], rel=1e-3)
    assert set(f["stages"]) == {"op", "region", "model"} and all(s["s"] > 0 for s in f["stages"].values())
    # peak RSS from wait4 is the child's own: at least what it saw of itself at its end
    for child in ("carve", "migrate"):
        assert f[child]["peak_rss_bytes"] >= f[child]["peak_rss_self_bytes"] > 50 << 20
    assert f["peak_rss_vs_params"] == pytest.approx(f["peak_rss_bytes"] / f["param_bytes"], rel=1e-3)
    assert f["passed"] is True and f["ops_share"] == 1.0 and len(f["load_avg"]) == 3
    assert "zoo:mlp carve + migrate to reference s" in " ".join(r.stdout.split())


def test_stage_clock_and_timed_platform_add_up():
    """The accumulator the migration is given, and the platform wrapper that times compile and run."""
    from tapml.bench import StageClock, TimedPlatform, matmul_graph
    from tapml.platforms.reference import ReferencePlatform
    import torch
    clock = StageClock()
    platform = TimedPlatform(ReferencePlatform(), clock)
    program = platform.compile(matmul_graph(8))
    out = platform.run(program, [torch.eye(8), torch.ones(8, 8)])[0]
    assert torch.equal(out, torch.ones(8, 8)) and platform.name == "reference"
    with clock.measure("compare"):
        pass
    assert set(clock.seconds) == {"compile", "device", "compare"} and all(v >= 0 for v in clock.seconds.values())


def test_scale_bad_usage_exits_2():
    r = tapml("bench", "scale", "--model", "hf:no_such_type", "--target", "reference", timeout=120)
    assert r.returncode == 2 and "unknown transformers model type" in r.stderr, r.stdout + r.stderr
    r = tapml("bench", "scale", "--model", "zoo:mlp", "--hf-config", "n_layer=1", timeout=60)
    assert r.returncode == 2 and "applies to hf:MODEL_TYPE" in r.stderr
