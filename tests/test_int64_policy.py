"""Device tier: the int64 policy, inputs and outputs alike.

WGSL has no 64-bit integers. tapml's WGSL targets hold an int64 tensor as i32 while its values
fit and in two 32-bit words where they do not (platforms/wgsl/int64.py), so such a case passes
and its verdict names the tensors held in two words. A target that holds int64 in 32 bits
only (a program compiled elsewhere, another backend) gets the comparison's policy: a value
outside the i32 range makes the case ``unsupported`` with the reason
``tapml.judging.compare.INT64_OUTSIDE_I32``, whether it is in an input (refused at upload) or
only in the reference's output; a real difference inside the range stays a ``mismatch``.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from tapml.judging.compare import I32_RANGE, INT64_OUTSIDE_I32, compare_outputs, compare_tensor
from tapml.errors import Unsupported
from tapml.graph import run_node
from tapml.platforms.wgpu_native import available_backends, shared_platform
from tapml.platforms.wgsl.registry import case_graph
from tapml.judging.verdict import outcome_verdict

INT64_MIN = -2**63
pytestmark = [pytest.mark.device,
              pytest.mark.skipif("vulkan" not in available_backends(),
                                 reason="no Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")]


@pytest.fixture(scope="module")
def vulkan():
    return shared_platform("vulkan")


def _verdict(platform, op, args, kwargs=None):
    """The verdict of one op run on ``platform``, judged as replay judges a case."""
    graph, inputs = case_graph(op, args, kwargs)
    expected = run_node(graph.nodes[0], dict(zip([r for r, _ in graph.inputs], inputs)).__getitem__)
    try:
        outputs = platform.run(platform.compile(graph), inputs)
    except Unsupported as e:
        return outcome_verdict(e), expected, None
    return outcome_verdict(compare_outputs(outputs, expected, op=op)), expected, outputs


def test_an_output_outside_i32_is_computed_in_two_words(vulkan):
    x = torch.tensor([-math.inf, 1.5, -3.0, 7.0])
    verdict, expected, outputs = _verdict(vulkan, "aten._to_copy.default", [x], {"dtype": torch.int64})
    assert int(expected[0][0]) == INT64_MIN  # the CPU reference: -inf becomes INT64_MIN
    assert outputs[0].tolist() == [INT64_MIN, 1, -3, 7]
    assert verdict.status == "pass" and vulkan.last_wide == ("n0",)


def test_an_input_outside_i32_is_computed_in_two_words(vulkan):
    verdict, _, outputs = _verdict(vulkan, "aten.add.Tensor", [torch.tensor([1, 2**40]), torch.tensor([1, 1])])
    assert verdict.status == "pass" and outputs[0].tolist() == [2, 2**40 + 1]
    assert vulkan.last_wide == ("n0", "x0")


def test_a_program_compiled_elsewhere_keeps_the_i32_policy(vulkan):
    from tapml.platforms.base import KernelProgram
    graph, inputs = case_graph("aten.add.Tensor", [torch.tensor([1, 2]), torch.tensor([1, 1])])
    elsewhere = KernelProgram.from_json(vulkan.compile(graph).to_json())
    elsewhere.kernels[0].name += "_elsewhere"  # another key: a program this platform did not compile
    with pytest.raises(Unsupported) as e:
        vulkan.run(elsewhere, [torch.tensor([1, 2**40]), torch.tensor([1, 1])])
    assert INT64_OUTSIDE_I32 in str(e.value) and str(2**40) in str(e.value)


def test_int32_boundaries_fit_and_pass(vulkan):
    lo, hi = I32_RANGE
    verdict, expected, outputs = _verdict(vulkan, "aten.neg.default", [torch.tensor([lo + 1, -1, 0, hi])])
    assert verdict.status == "pass", verdict.message
    assert outputs[0].tolist() == [hi, 1, 0, -hi]


def test_a_difference_inside_the_range_stays_a_mismatch():
    ref = torch.tensor([INT64_MIN, 4, 5])
    only_wide = compare_tensor(torch.tensor([I32_RANGE[0], 4, 5]), ref)
    assert not only_wide.passed and only_wide.unsupported.startswith(INT64_OUTSIDE_I32)
    both = compare_tensor(torch.tensor([I32_RANGE[0], 3, 5]), ref)
    assert not both.passed and not both.unsupported
    assert outcome_verdict(both).status == "mismatch"
    assert "outside the i32 range" in both.message
    # a real mismatch in any output outweighs another output the target cannot hold
    merged = compare_outputs([torch.tensor([I32_RANGE[0]]), torch.tensor([1.0])], [torch.tensor([INT64_MIN]), torch.tensor([2.0])])
    assert outcome_verdict(merged).status == "mismatch"
    only = compare_outputs([torch.tensor([I32_RANGE[0]]), torch.tensor([2.0])], [torch.tensor([INT64_MIN]), torch.tensor([2.0])])
    assert outcome_verdict(only).status == "unsupported" and only.unsupported.startswith("output 0: " + INT64_OUTSIDE_I32)


def test_a_target_with_64_bit_integers_still_passes():
    ref = torch.tensor([INT64_MIN, 2**40])
    assert outcome_verdict(compare_tensor(ref.clone(), ref)).status == "pass"


def test_replay_of_a_carved_model_passes_and_names_the_two_word_tensors(tmp_path, vulkan):
    from tapml.carving import CarveStore, carve
    from tapml.driving.replay import replay
    model = tmp_path / "to_int.py"
    model.write_text(textwrap.dedent("""
        import torch

        class ToInt(torch.nn.Module):
            def forward(self, x):
                return torch.log(x).to(torch.int64), (x * 3).to(torch.int64)

        def factory():
            return ToInt(), (torch.tensor([0.0, 1.0, 20.0, 1000.0]),)
    """))
    carve(f"{model}:factory", tmp_path / "store")
    doc = replay(CarveStore(tmp_path / "store"), vulkan, "wgpu:vulkan")
    by_status = {}
    for case in doc["cases"]:
        by_status.setdefault(case["status"], []).append(case)
    assert set(by_status) == {"pass"}, doc["cases"]
    wide = [c for c in doc["cases"] if c.get("int64_two_words")]
    assert [c["op"] for c in wide] == ["aten._to_copy.default"]  # log(0) = -inf becomes INT64_MIN
    assert "held in two 32-bit words" in wide[0]["message"]
