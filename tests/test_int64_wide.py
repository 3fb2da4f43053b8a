"""int64 past i32 in two 32-bit words (platforms/wgsl/int64.py, issue 36 item 1-3).

Every two-word lowering's samples (values at and past the i32 limits and at the int64 limits,
overflow wrapping as torch wraps) run on lavapipe Vulkan, llvmpipe GL (device tier) and Chromium
(browser tier) and must equal torch exactly, casts to and from every dtype included. A T5-style
bucket function (the values of ``-inf.to(long)`` pass through ``minimum`` and ``where``) runs as
one region. The fast path stays: values that fit keep i32. Split buffers, resident outputs and a
loopback ``tapml serve`` carry the two-word form. Fast tier: the choice of refs, the WGSL arithmetic
against Python's on the host (no device), the verdict's field."""

from __future__ import annotations

import math

import pytest
import torch

from tapml.graph import graph_from_fx, run_graph
from tapml.platforms.wgsl.int64 import (I64_MAX, I64_MIN, WIDE_LOWERINGS, cast_samples, static_wide_refs, where_samples,
                                        wide_ints, wide_refs)
from tapml.platforms.wgsl.registry import case_graph
from tests.support import accepted_samples, exported, on_every_webgpu, own_wgpu


def _cases():
    """(op, args, kwargs) of every two-word sample that its op's schema accepts."""
    out = accepted_samples(WIDE_LOWERINGS)
    out += [("aten._to_copy.default", a, k) for a, k in cast_samples()]
    out += [("aten.where.self", a, k) for a, k in where_samples()]
    out += [("aten.cat.default", ([wide_ints(2, 3), wide_ints(4, 3)],), {}),
            ("aten.index_select.default", (wide_ints(6, 4), 0, torch.tensor([5, 0, 3])), {}),
            ("aten.permute.default", (wide_ints(2, 3, 4), [2, 0, 1]), {}),
            ("aten.full.default", ([3, 2], I64_MIN), {"dtype": torch.int64}),
            ("aten.full_like.default", (wide_ints(5), 15), {}),
            # rows past the loop budget: split across invocations, partial states in two words
            ("aten.sum.dim_IntList", (wide_ints(3, 6000), [1]), {}),
            ("aten.prod.dim_int", (wide_ints(2, 5000, lo=-3, hi=4), 1), {}),
            ("aten.cumsum.default", (wide_ints(2, 5000), 1), {}),
            ("aten.argmax.default", (wide_ints(2, 9000), 1), {}),
            ("aten.min.dim", (wide_ints(2, 9000), 1), {}),
            ("aten.sort.default", (wide_ints(3, 5000), 1, True), {}),
            ("aten.topk.default", (wide_ints(2, 3000), 9), {})]
    return out


def _expected(graph, inputs):
    got = run_graph(graph, dict(zip([r for r, _ in graph.inputs], inputs)))
    return [got[r] for r in graph.outputs]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num()) and \
        torch.equal(a.isnan(), b.isnan())


def _check_samples(platform):
    ran, bad = set(), []
    for op, args, kwargs in _cases():
        graph, inputs = case_graph(op, args, kwargs)
        outputs = platform.run(platform.compile(graph), inputs)
        assert platform.last_wide, f"{op} {kwargs}: no tensor held in two words"
        for got, want in zip(outputs, _expected(graph, inputs)):
            if not _equal(got, want):
                bad.append((op, kwargs, got.flatten()[:4].tolist(), want.flatten()[:4].tolist()))
        ran.add(op)
    assert not bad, bad[:5]
    assert ran >= set(WIDE_LOWERINGS), set(WIDE_LOWERINGS) - ran  # every two-word lowering ran


def _buckets(relative_position: torch.Tensor) -> torch.Tensor:
    """T5's relative-position buckets (bidirectional=False, 32 buckets, max distance 128)."""
    relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = 16
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(128 / max_exact)
                         * (32 - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, 31))
    return torch.where(is_small, relative_position, large)


def _check_t5_region(platform):
    pos = torch.arange(40)
    relative = pos[None, :] - pos[:, None]
    ep = exported(lambda r: (_buckets(r),), relative)
    graph = graph_from_fx(ep.graph, ep.graph_signature)
    out = platform.run(platform.compile(graph), [relative])
    assert torch.equal(out[0], _buckets(relative))
    assert platform.last_wide  # -inf.to(long) is -2**63: held in two words inside the region
    assert graph.outputs[0] not in platform.last_wide  # the buckets themselves fit: i32


def _check(platform):
    with platform:
        _check_samples(platform)
        _check_t5_region(platform)


test_two_word_int64_equals_torch, test_two_word_int64_equals_torch_in_chromium = on_every_webgpu(_check)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_values_that_fit_keep_i32():
    with own_wgpu("vulkan") as vulkan:
        graph, inputs = case_graph("aten.add.Tensor", [torch.tensor([1, 2**31 - 2]), torch.tensor([1, 1])])
        program = vulkan.compile(graph)
        out = vulkan.run(program, inputs)
        assert out[0].tolist() == [2, 2**31 - 1] and vulkan.last_wide == ()
        assert {b.dtype for b in program.buffers} == {"i32"}
        # one past: the sum (not the inputs) needs two words
        inputs = [torch.tensor([1, 2**31 - 1]), torch.tensor([1, 1])]
        assert vulkan.run(program, inputs)[0].tolist() == [2, 2**31]
        assert vulkan.last_wide == ("n0",)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_two_words_across_split_buffers_and_resident_outputs():
    from tapml.platforms.base import ResidentTensor
    with own_wgpu("vulkan") as vulkan:
        vulkan.force_limits({"max-storage-buffer-binding-size": 4096, "max-buffer-size": 8192})
        a, b = wide_ints(3000), wide_ints(3000, limits=(7, -1))
        graph, inputs = case_graph("aten.mul.Tensor", [a, b])
        program = vulkan.compile(graph)
        assert torch.equal(vulkan.run(program, inputs)[0], a * b)
        wide_program = vulkan.for_values(program, inputs)
        assert len(wide_program.parts) == 3  # a, b and the product: each over max-buffer-size
        graph, inputs = case_graph("aten.sub.Tensor", [wide_ints(500), wide_ints(500, limits=(3,))])
        program = vulkan.compile(graph)
        kept = vulkan.run(program, inputs, keep=[0])[0]
        assert isinstance(kept, ResidentTensor) and kept.dtype == "int64"
        assert torch.equal(vulkan.read(kept), inputs[0] - inputs[1])


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_two_words_through_a_loopback_server(tmp_path):
    from tapml.remote.client import RemotePlatform
    from tapml.remote.launcher import ServerProcess
    with ServerProcess(platform="wgpu:vulkan", token="two-words") as server:
        with RemotePlatform(server.host, server.port, token="two-words") as remote:
            x = torch.tensor([float("-inf"), 3e19, -2.5, 7e12])
            graph, inputs = case_graph("aten._to_copy.default", [x], {"dtype": torch.int64})
            out = remote.run(remote.compile(graph), inputs)
            assert out[0].tolist() == x.to(torch.int64).tolist()
            assert remote.last_wide == ("n0",)  # the server says what it held in two words
            # uint64 and complex32 cross the wire as their bytes, and run there
            u = torch.tensor([1, 2**63 + 5, 2**64 - 1], dtype=torch.uint64)
            graph, inputs = case_graph("aten.mul.Tensor", [u, u])
            assert torch.equal(remote.run(remote.compile(graph), inputs)[0], u * u)
            z = torch.tensor([1 + 2j, -0.5 + 3j], dtype=torch.complex64).to(torch.complex32)
            graph, inputs = case_graph("aten.mul.Tensor", [z, z])
            assert torch.equal(torch.view_as_real(remote.run(remote.compile(graph), inputs)[0]),
                               torch.view_as_real(z * z))


# --- fast tier: no device -----------------------------------------------------------------

def test_wide_refs_follow_the_values():
    graph, inputs = case_graph("aten.mul.Tensor", [torch.tensor([3, 4]), torch.tensor([5, 6])])
    assert wide_refs(graph, inputs) == frozenset()
    assert wide_refs(graph, [torch.tensor([3, 2**20]), torch.tensor([5, 2**20])]) == {"n0"}
    assert wide_refs(graph, [torch.tensor([2**40]), torch.tensor([0])]) == {"x0"}
    graph, _ = case_graph("aten.full.default", [[2], 2**40], {"dtype": torch.int64})
    assert static_wide_refs(graph) == {"n0"}


def test_a_verdict_names_the_refs_held_in_two_words():
    from tapml.judging.verdict import CaseVerdict
    v = CaseVerdict(id="c", op="aten.add.Tensor", status="pass", int64_two_words=["x0", "n0"])
    assert v.to_json()["int64_two_words"] == ["x0", "n0"]
    assert "int64_two_words" not in CaseVerdict(id="c", op="aten.add.Tensor", status="pass").to_json()


TO_INT = '''
import torch

class ToInt(torch.nn.Module):
    def forward(self, x):
        big = torch.log(x).to(torch.int64) * 3
        return torch.minimum(big, torch.full_like(big, 7)) + 2**40

def factory():
    return ToInt(), (torch.tensor([0.0, 1.0, 20.0, 1000.0, float("inf")]),)
'''


@pytest.fixture(scope="module")
def wide_repro(tmp_path_factory):
    """A repro folder of a region whose int64 values (log(0) as int64 is -2**63) pass i32."""
    from tests.test_repro import make_repro
    from tests.support import store_from_source
    store = store_from_source(tmp_path_factory, "to_int", TO_INT)
    folder = tmp_path_factory.mktemp("repro") / "wide"
    plan = make_repro(store.path, "_to_copy..add", folder)
    return folder, plan


@pytest.mark.device
def test_a_repro_folder_carries_two_words_and_passes_outside_tapml(wide_repro):
    import subprocess
    import sys
    folder, plan = wide_repro
    assert {i["device_type"] for i in plan["inputs"]} == {"f32"}
    assert [o["device_type"] for o in plan["outputs"]] == ["i64"]
    r = subprocess.run([sys.executable, "run.py", "--backend", "vulkan"], cwd=folder, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.browser
def test_a_repro_page_compares_two_word_int64_exactly(wide_repro):
    from tests.support import repro_page_result
    assert repro_page_result(wide_repro[0]).startswith("PASS")


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("target", ["wgpu:vulkan", "wgpu:gl"])
def test_t5_migrates_with_every_op_on_the_target(tmp_path, target):
    """hf:t5's relative-position buckets hold ``-inf.to(long)`` = -2**63 on the way (issue 36's first
    "Done when"): every op on the target, and the cases that held int64 in two words say so."""
    import json
    from typer.testing import CliRunner
    from tapml.cli import app
    state = tmp_path / "t5.json"
    r = CliRunner().invoke(app, ["migrate", "hf:t5", "--target", target, "--state", str(state), "--quiet"])
    assert r.exit_code == 0, r.output
    doc = json.loads(state.read_text())
    assert doc["placement"]["ops_on_target"] == doc["placement"]["ops_total"], doc["placement"]
    wide = {c["op"] for c in doc["cases"] if c.get("int64_two_words")}
    assert {"aten._to_copy.default", "aten.minimum.default"} <= wide, wide


@pytest.mark.device
def test_inspect_target_counts_the_cases_held_in_two_words(tmp_path_factory, tmp_path):
    import json
    from typer.testing import CliRunner
    from tapml.cli import app
    from tests.support import store_from_source
    store = store_from_source(tmp_path_factory, "to_int_inspect", TO_INT)
    r = CliRunner().invoke(app, ["inspect", str(store.path), "--target", "wgpu:vulkan", "--json", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    counts = {o["op"]: o["int64_two_words"] for o in json.loads((tmp_path / "p.json").read_text())["ops"]}
    assert counts["aten._to_copy.default"] == 1 and counts["aten.log.default"] == 0, counts
    r = CliRunner().invoke(app, ["inspect", str(store.path), "--target", "wgpu:vulkan"])
    assert r.exit_code == 0, r.output  # the table (its column wraps at the runner's width) prints


# --- every op that claims int64, with values past i32 ----------------------------------------

#: Ops that claim int64 whose two-word path is not written yet: with values past i32 they are
#: refused (``unsupported``, naming the op and two words), never run wrong.
NOT_YET: frozenset[str] = frozenset()
#: Ops that claim int64 but no int64 operand of which can hold a value past i32 (``wide_limit_cases``
#: finds none torch accepts), with the reason; their creation siblings are in EXTRA_CASES.
NO_WIDE_OPERAND: dict[str, str] = {
    **{op: "int64 only as indices, offsets or lengths: torch refuses values past the tensor" for op in (
        "aten._embedding_bag.default", "aten._embedding_bag_forward_only.default", "aten.segment_reduce.default",
        "aten.max_pool2d_with_indices_backward.default", *(f"tapml.{q}_embedding.default" for q in (
            "q4_0", "q4_k", "q4f16_1", "q4f32_1", "q5_0", "q8_0")))},
    "aten.bincount.default": "counts into a tensor as long as its largest value; int64 weights give float64",
    **{op: "no values: an uninitialized tensor" for op in (
        "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_permuted.default")},
    **{op: "its values (0, 1, positions below its length) fit whenever the tensor does" for op in (
        "aten.ones.default", "aten.zeros.default", "aten.randperm.default", "aten.arange.default")},
}
#: Ops with no tensor operand: their values past i32 come from their arguments.
EXTRA_CASES = {
    "aten.arange.start": [([-(2**31) - 5, -(2**31) + 5], {"dtype": torch.int64})],
    "aten.arange.start_step": [([2**40, 2**40 + 50, 7], {"dtype": torch.int64}),
                               ([2**62, 2**62 - 20 * 2**58, -(2**58)], {"dtype": torch.int64})],
    "aten.full.default": [([[3, 2], I64_MIN], {"dtype": torch.int64}), ([[4], 2**40], {"dtype": torch.int64})],
    "aten.scalar_tensor.default": [([-(2**50)], {"dtype": torch.int64})],
    "aten.where.Scalar": [([torch.tensor([True, False, True]), 2**40, I64_MIN], {})],
    "aten.randint.low": [([2**40, 2**41, [1000]], {}), ([I64_MIN, I64_MAX, [1000]], {})],
    "aten.randint.default": [([2**33, [500]], {})],
}


def _int64_claims() -> list[str]:
    from tapml.platforms.wgsl import load_lowerings
    return sorted(op for op, low in load_lowerings().items() if "int64" in low.dtypes and not low.view)


def _outcome(platform, graph, inputs, ref, compare_values: bool, held_wide: bool = True) -> str | None:
    """None when the device gives torch's outputs (exactly, for integers), else what went wrong
    (``held_wide``: some int64 tensor must have been held in two words)."""
    from tapml.errors import Unsupported
    from tapml.judging.compare import compare_tensor
    try:
        outputs = platform.run(platform.compile(graph), inputs)
    except Unsupported as e:
        return f"unsupported: {e}"
    if held_wide and not platform.last_wide:
        return "no tensor was held in two words"
    for got, want in zip(outputs, ref):
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
        if compare_values and not compare_tensor(got, want).passed:
            return compare_tensor(got, want).message
    return None


def _cases_of(op: str, generated, extra: dict) -> list:
    """``generated(op, most=3)``'s cases of ``op`` and its own ``extra`` ones: ``(graph, inputs, torch's outputs)``."""
    cases = generated(op, most=3)
    for args, kwargs in extra.get(op, []):
        graph, inputs = case_graph(op, args, kwargs)
        cases.append((graph, inputs, _expected(graph, inputs)))
    return cases


def _check_every_claim(platform):
    from tapml.platforms.wgsl import load_lowerings
    from tests.support import wide_limit_cases
    registry = load_lowerings()
    wrong, refused, without = [], set(), []
    with platform:
        for op in _int64_claims():
            cases = _cases_of(op, wide_limit_cases, EXTRA_CASES)
            if not cases:
                without.append(op)
            for graph, inputs, ref in cases:
                problem = _outcome(platform, graph, inputs, ref, registry[op].compare_values)
                if problem is None:
                    continue
                if op in NOT_YET and problem.startswith("unsupported") and "two 32-bit words" in problem:
                    refused.add(op)
                else:
                    wrong.append((op, problem[:200]))
    assert not wrong, wrong
    assert refused == NOT_YET, sorted(NOT_YET - refused)  # the list is current
    assert set(without) == set(NO_WIDE_OPERAND), set(without) ^ set(NO_WIDE_OPERAND)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_random_draws_past_i32_stay_in_their_range():
    """randint's values cannot be compared with torch's: they must lie in [low, high) and spread."""
    with own_wgpu("vulkan") as vulkan:
        for args in ([2**40, 2**41, [2000]], [I64_MIN, I64_MAX, [2000]]):
            graph, inputs = case_graph("aten.randint.low", args)
            out = vulkan.run(vulkan.compile(graph), inputs)[0]
            assert out.dtype == torch.int64 and vulkan.last_wide
            assert bool(((out >= args[0]) & (out < args[1])).all())
            assert len(set(out.tolist())) == 2000  # 64-bit draws: no repeats among 2000
            assert abs(out.double().mean().item() - (args[0] + args[1]) / 2) < (args[1] - args[0]) * 0.05


test_every_int64_claim_holds_past_i32, test_every_int64_claim_holds_past_i32_in_chromium = \
    on_every_webgpu(_check_every_claim)


# --- uint64: two words read as unsigned ------------------------------------------------------

U64_LIMITS = torch.tensor([0, 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1, 2**32, 2**32 - 1, 2**31, 12345],
                          dtype=torch.uint64)

#: Ops with no uint64 operand among the int64 samples: their own cases.
UINT64_EXTRA_CASES = {
    "aten.full.default": [([[3, 2], 2**64 - 1], {"dtype": torch.uint64}), ([[2], 2**63 + 5], {"dtype": torch.uint64})],
    "aten.ones.default": [([[4]], {"dtype": torch.uint64})],
    "aten.zeros.default": [([[4]], {"dtype": torch.uint64})],
    "aten.scalar_tensor.default": [([2**63 + 1], {"dtype": torch.uint64})],
    "aten.flip.default": [([U64_LIMITS.reshape(2, 5), [0]], {})],
    "aten._to_copy.default": [([U64_LIMITS], {"dtype": d}) for d in (torch.float32, torch.int64, torch.int32, torch.bool,
                                                                      torch.float16, torch.uint8)] + [
        ([torch.tensor([0.0, 1.5, 2.0**63, 2.0**64 - 2.0**40, 9.2e18, 1e19, 3.0e9])], {"dtype": torch.uint64}),
        ([torch.tensor([0, -1, 2**62, -(2**63), 7])], {"dtype": torch.uint64}),
        ([torch.tensor([0, -1, 2**31 - 1, -5], dtype=torch.int32)], {"dtype": torch.uint64})],
    "aten.sort.default": [([U64_LIMITS.reshape(2, 5), 1, True], {}), ([U64_LIMITS, 0], {})],
    "aten.mul.Scalar": [([U64_LIMITS, 2**64 - 1], {}), ([U64_LIMITS, 0xFF51AFD7ED558CCD], {})],
    "aten.sum.dim_IntList": [([U64_LIMITS.reshape(2, 5), [1]], {})],
}


def _uint64_claims() -> list[str]:
    from tapml.platforms.wgsl.int64 import UINT64_AS_ANY, UINT64_SAME_BITS
    return sorted(UINT64_SAME_BITS | UINT64_AS_ANY)


def _check_uint64(platform):
    from tapml.platforms.wgsl import load_lowerings
    from tests.support import uint64_cases
    registry = load_lowerings()
    wrong, without = [], []
    with platform:
        for op in _uint64_claims():
            cases = _cases_of(op, uint64_cases, UINT64_EXTRA_CASES)
            if not cases:
                without.append(op)
            for graph, inputs, ref in cases:
                problem = _outcome(platform, graph, inputs, ref, registry[op].compare_values, held_wide=False)
                if problem is not None:
                    wrong.append((op, problem[:200]))
    assert not wrong, wrong
    assert not without, without  # every op routed for uint64 ran on uint64 values past 2**63


test_uint64_equals_torch, test_uint64_equals_torch_in_chromium = on_every_webgpu(_check_uint64)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_a_uint64_hash_migrates_whole(tmp_path):
    """Feature hashing on uint64 (tests/models/uint64_hash.py): carved, then every op on the target."""
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from tapml.cli import app
    store, state = tmp_path / "store", tmp_path / "state.json"
    model = Path(__file__).parent / "models" / "uint64_hash.py"
    r = CliRunner().invoke(app, ["carve", f"{model}:model", "-o", str(store)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["migrate", str(store), "--target", "wgpu:vulkan", "--state", str(state), "--quiet"])
    assert r.exit_code == 0, r.output
    doc = json.loads(state.read_text())
    assert doc["placement"]["ops_on_target"] == doc["placement"]["ops_total"], doc["placement"]
    assert {"aten.mul.Tensor", "aten.bitwise_xor.Tensor"} <= {c["op"] for c in doc["cases"] if c["status"] == "pass"}


@pytest.fixture(scope="module")
def uint64_repro(tmp_path_factory):
    """A repro folder of the uint64 hash's mixing region (uint64 in, uint64 out)."""
    from pathlib import Path

    from tests.test_repro import make_repro
    from tapml.carving import CarveStore, carve
    base = tmp_path_factory.mktemp("u64")
    carve(f"{Path(__file__).parent / 'models' / 'uint64_hash.py'}:model", base / "store")
    folder = base / "repro"
    plan = make_repro(CarveStore(base / "store").path, "_to_copy..bitwise_xor", folder)
    return folder, plan


@pytest.mark.device
def test_a_repro_folder_carries_uint64_and_passes_outside_tapml(uint64_repro):
    import subprocess
    import sys
    folder, plan = uint64_repro
    assert [o["device_type"] for o in plan["outputs"]] == ["u64"]
    r = subprocess.run([sys.executable, "run.py", "--backend", "vulkan"], cwd=folder, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr


@pytest.mark.browser
def test_a_repro_page_compares_uint64_exactly(uint64_repro):
    from tests.support import repro_page_result
    assert repro_page_result(uint64_repro[0]).startswith("PASS")
