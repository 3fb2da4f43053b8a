import math

import pytest
import torch

from tapml.judging.compare import Tolerances, compare_anchored, compare_outputs, compare_tensor
from tapml.errors import TapmlError


def test_equal_floats_pass_with_zero_error():
    t = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    c = compare_tensor(t.clone(), t)
    assert c.passed and c.max_abs_err == 0.0 and c.mismatch_fraction == 0.0


def test_float_tolerance_is_elementwise_atol_plus_rtol():
    r = torch.tensor([1.0, 100.0])
    assert compare_tensor(r + torch.tensor([1e-4 + 1e-3 * 1 - 1e-6, 0.0]), r).passed
    c = compare_tensor(r + torch.tensor([0.0, 0.2]), r)
    assert not c.passed
    assert c.mismatch_fraction == 0.5
    assert c.max_abs_err == pytest.approx(0.2, rel=1e-3)
    assert c.worst[0]["index"] == [1]


def test_shape_and_dtype_checked_before_values():
    c = compare_tensor(torch.zeros(2, 3), torch.zeros(3, 2))
    assert not c.passed and "shape" in c.message
    c = compare_tensor(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
    assert not c.passed and "dtype" in c.message


def test_integers_and_bools_are_exact():
    r = torch.tensor([1, 2, 3])
    assert compare_tensor(r.clone(), r).passed
    c = compare_tensor(torch.tensor([1, 2, 4]), r)
    assert not c.passed and c.max_abs_err == 1.0
    assert not compare_tensor(torch.tensor([True, False]), torch.tensor([True, True])).passed


def test_nan_and_inf_must_match_position_and_sign():
    r = torch.tensor([1.0, math.nan, math.inf, -math.inf])
    assert compare_tensor(r.clone(), r).passed
    assert not compare_tensor(torch.tensor([1.0, 0.0, math.inf, -math.inf]), r).passed
    assert not compare_tensor(torch.tensor([1.0, math.nan, -math.inf, -math.inf]), r).passed
    c = compare_tensor(torch.tensor([math.nan, math.nan, math.inf, -math.inf]), r)
    assert not c.passed and "NaN/Inf" in c.message and c.max_abs_err is None


def test_float16_defaults_are_looser():
    r = torch.tensor([1.0], dtype=torch.float16)
    assert compare_tensor(r + 5e-3, r).passed
    assert not compare_tensor(r.float() + 5e-3, r.float()).passed


def test_tolerance_overrides_per_op_and_global():
    tol = Tolerances.parse(["aten.mm.default=0.1,0.1", "1e-2,1e-3"])
    assert tol.get("aten.mm.default", "float32") == (0.1, 0.1)
    assert tol.get("aten.add.Tensor", "float32") == (1e-2, 1e-3)
    assert Tolerances.parse(["aten.mm=0.5,0"]).get("aten.mm.default", "float32") == (0.5, 0.0)
    r = torch.ones(4)
    assert compare_outputs([r + 0.05], [r], op="aten.mm.default", tolerances=tol).passed
    assert not compare_outputs([r + 0.05], [r], op="aten.add.Tensor", tolerances=tol).passed


@pytest.mark.parametrize("bad", ["aten.mm.default=1e-3", "x=a,b", "=1,2,3", "aten.mm.default=-1,0", "1e-3,inf"])
def test_bad_tolerance_syntax_says_what_to_fix(bad):
    with pytest.raises(TapmlError, match="RTOL,ATOL"):
        Tolerances.parse([bad])


def test_multiple_outputs_report_the_failing_one():
    a = torch.randn(3, generator=torch.Generator().manual_seed(1))
    c = compare_outputs([a, a + 1], [a, a])
    assert not c.passed and c.message.startswith("output 1")
    assert not compare_outputs([a], [a, a]).passed


def test_fp64_anchored_accepts_errors_like_the_references_own():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(2))
    r64 = (x.double() @ x.double())
    r32 = x @ x
    # A target as exact as float32 can be passes; one far off fails.
    assert compare_anchored([r32.clone()], [r32], [r64]).passed
    assert not compare_anchored([r32 + 1e-2], [r32], [r64]).passed


def test_low_precision_against_float32_scales_atol_to_the_tensor():
    """A float16 run judged against the float32 model: rtol of float16, atol at least rtol times
    the tensor's largest value; Inf where float32 is finite and errors at the tensor's scale fail."""
    from tapml.judging.compare import Tolerances
    expected = torch.tensor([100.0, 0.5, -0.01, 0.0])
    rtol, atol = Tolerances().against_float32("aten.mm.default", "float16", expected)
    assert (rtol, atol) == (1e-2, 1.0)
    assert compare_tensor(expected + torch.tensor([0.5, 0.9, 0.9, 0.9]), expected, rtol, atol).passed
    assert not compare_tensor(expected + torch.tensor([0.0, 1.1, 0.0, 0.0]), expected, rtol, atol).passed
    assert not compare_tensor(torch.tensor([math.inf, 0.5, -0.01, 0.0]), expected, rtol, atol).passed
    small = torch.tensor([1e-4, -2e-4])
    assert Tolerances().against_float32(None, "float16", small) == (1e-2, 1e-3)  # the dtype's own atol at least
    assert Tolerances().against_float32(None, "bfloat16", expected) == (2e-2, 2.0)
    override = Tolerances.parse(["aten.mm=1e-4,1e-5"])
    assert override.against_float32("aten.mm.default", "float16", expected) == (1e-4, 1e-5)


def test_large_tensors_are_compared_in_chunks_with_the_same_result():
    from tapml.judging.compare import CHUNK
    ref = torch.rand(2 * CHUNK + 6) + 1
    got = ref.clone()
    got[CHUNK + 7] += 1.0          # second chunk: the worst
    got[2 * CHUNK + 1] += 0.5      # last, partial chunk
    got[3] = float("nan")          # first chunk: NaN where the reference is finite
    res = compare_tensor(got.reshape(2, -1)[:, :], ref.reshape(2, -1))
    assert not res.passed and res.message.startswith(f"3/{ref.numel()} elements mismatch")
    assert "NaN/Inf differ at 1 positions" in res.message
    flat = [i[0] * (ref.numel() // 2) + i[1] for i in (w["index"] for w in res.worst)]
    assert flat == [3, CHUNK + 7, 2 * CHUNK + 1]  # NaN first (an infinite error), then by size
    assert res.max_abs_err is None  # the NaN makes the largest error infinite
    ok = compare_tensor(ref.clone(), ref)
    assert ok.passed and ok.max_abs_err == 0.0 and ok.mismatch_fraction == 0.0


def test_sort_indices_that_only_reorder_ties_pick_the_same_values():
    from tapml.judging.compare import indices_pick_equal_values, tie_dim
    x = torch.tensor([[3.0, 1.0, 3.0, float("nan"), 1.0]])
    values, ref = torch.sort(x, dim=-1, stable=True)  # [1, 1, 3, 3, nan] at [1, 4, 0, 2, 3]
    swapped = ref[:, [1, 0, 3, 2, 4]]  # equal values, the other order
    assert indices_pick_equal_values(x, -1, swapped, values)
    assert not indices_pick_equal_values(x, -1, torch.tensor([[1, 1, 0, 2, 3]]), values)  # an index twice
    assert not indices_pick_equal_values(x, -1, torch.tensor([[1, 4, 0, 3, 2]]), values)  # 3 and nan swapped
    assert not indices_pick_equal_values(x, -1, torch.tensor([[1, 4, 0, 2, 5]]), values)  # out of range
    assert tie_dim("aten.topk.default", [{"ref": "x"}, 2, 0], {}) == 0
    assert tie_dim("aten.sort.default", [{"ref": "x"}], {}) == -1
    assert tie_dim("aten.sort.stable", [{"ref": "x"}], {"stable": True, "dim": 0}) is None  # ties in input order
    assert tie_dim("aten.add.Tensor", [{"ref": "x"}], {}) is None


def test_reduction_indices_of_equal_values_pass_without_keepdim():
    from tapml.judging.compare import indices_pick_equal_values, tie_dim
    x = torch.tensor([[2.0, 1.0, 2.0, 1.0], [float("nan"), 5.0, float("nan"), 0.0]])
    values = torch.tensor([2.0, float("nan")])  # kthvalue(x, 3, 1): any index of the equal values
    assert indices_pick_equal_values(x, 1, torch.tensor([2, 0]), values)
    assert indices_pick_equal_values(x, -1, torch.tensor([0, 2]), values)
    assert not indices_pick_equal_values(x, 1, torch.tensor([1, 0]), values)  # x[0, 1] is 1, not 2
    assert tie_dim("aten.kthvalue.default", [{"ref": "x"}, 3, 1], {}) == 1
    assert tie_dim("aten.mode.default", [{"ref": "x"}], {}) == -1
    assert tie_dim("aten.median.dim", [{"ref": "x"}, 0], {}) is None  # torch's median takes the stable sort's
