"""fp64-anchored judging: a target's error against a float64 recomputation, held to the
reference's own error against it times a factor, plus a floor."""

from __future__ import annotations

import torch

from tapml.judging.compare.values import CHUNK, DEFAULT_TOLERANCES, Comparison, Rule, compare_tensor, merge
from tapml.graph import dtype_name


#: fp64-anchored mode: a target may be this many times as far from the float64 result as the reference is.
ANCHOR_FACTOR = 4.0
#: fp64-anchored mode: the error always allowed on top, per dtype of the output (the dtype's
#: default atol for the low floats; 1e-6 for float32, whose default atol would hide real errors).
ANCHOR_FLOOR = {"float32": 1e-6, "float16": DEFAULT_TOLERANCES["float16"][1],
                "bfloat16": DEFAULT_TOLERANCES["bfloat16"][1], "float64": 1e-12}


def anchor_bound(low: torch.Tensor, anchor: torch.Tensor, factor: float = ANCHOR_FACTOR,
                 floor: float | None = None) -> tuple[float, float]:
    """``(bound, reference_error)``: the error against the float64 result ``anchor`` a target may
    have where the reference computed ``low``: ``factor`` times the reference's largest own error
    (over the tensor's finite elements) plus ``floor`` (None: the dtype's :data:`ANCHOR_FLOOR`)."""
    name = dtype_name(low.dtype)
    bound_floor = ANCHOR_FLOOR.get(name, ANCHOR_FLOOR["float32"]) if floor is None else floor
    ref_err = 0.0
    for lo, an in _chunks(low, anchor):
        both = torch.isfinite(lo) & torch.isfinite(an)
        if bool(both.any()):
            ref_err = max(ref_err, float((lo - an).abs()[both].max()))
    return factor * ref_err + bound_floor, ref_err


def _chunks(low: torch.Tensor, anchor: torch.Tensor):
    """``(low, anchor)`` in float64, :data:`CHUNK` elements at a time: a whole float64 copy of a
    large output (a [128000, 2048] weight's permute: 2 GiB each) is never made at once."""
    low, anchor = low.detach().cpu().reshape(-1), anchor.detach().cpu().reshape(-1)
    for at in range(0, low.numel(), CHUNK):
        yield low[at:at + CHUNK].double(), anchor[at:at + CHUNK].double()


def anchored_rule(low: torch.Tensor, anchor: torch.Tensor, factor: float = ANCHOR_FACTOR,
                  floor: float | None = None) -> Rule:
    """The fp64-anchored :class:`~tapml.judging.compare.values.Rule` for an output whose reference
    computed ``low`` and whose float64 result is ``anchor`` (see :func:`anchor_bound`): a
    target at least as close to float64 as the reference passes however far from the reference.

    Example: ``compare_tensor(t32, r32, rules=[anchored_rule(r32, r64)]).passed``."""
    bound, ref_err = anchor_bound(low, anchor, factor, floor)
    floor_used = bound - factor * ref_err
    return Rule("fp64-anchored", anchor, bound,
                f"reference {dtype_name(low.dtype)} error {ref_err:.3g}, factor {factor:g}, floor {floor_used:g}")


def compare_anchored(targets: list[torch.Tensor], refs32: list[torch.Tensor], refs64: list[torch.Tensor],
                     factor: float = ANCHOR_FACTOR, floor: float | None = None,
                     rules: list[list[Rule]] | None = None) -> Comparison:
    """fp64-anchored check: the target passes when its error against the float64 result is
    within ``factor`` (:data:`ANCHOR_FACTOR`, 4) times the reference's own error (the float32,
    float16 or bfloat16 reference ``refs32`` against ``refs64``) plus ``floor`` (None: the
    output dtype's :data:`ANCHOR_FLOOR`). Where the reference itself overflowed (±Inf or NaN
    where the float64 result is finite: the dtype's own range, not the target's fault) the
    target must match the reference there, as in the plain comparison. ``rules``: per output,
    further ways an element may pass (the arithmetic bound of :mod:`tapml.judging.compare.bounds`).

    Example: ``compare_anchored([t16], [r16], [r64]).passed``."""
    if len(targets) != len(refs32):
        return Comparison(False, message=f"{len(targets)} outputs != reference {len(refs32)}")
    results = []
    for i, (t, r32, r64) in enumerate(zip(targets, refs32, refs64)):
        if not r32.dtype.is_floating_point or tuple(t.shape) != tuple(r32.shape) or t.dtype != r32.dtype:
            results.append(compare_tensor(t, r32))  # exact, or a shape/dtype mismatch: no anchoring needed
            continue
        name = dtype_name(r32.dtype)
        anchor = r64.detach().cpu().double().contiguous()  # once: each pass below reads it flat
        if any(bool((~torch.isfinite(lo) & torch.isfinite(an)).any()) for lo, an in _chunks(r32, anchor)):
            low = r32.detach().cpu().double()  # where the reference overflowed, the target must match it
            anchor = torch.where(~torch.isfinite(low) & torch.isfinite(anchor), low, anchor)
            del low
        bound, ref_err = anchor_bound(r32, anchor, factor,
                                      ANCHOR_FLOOR.get(name, ANCHOR_FLOOR["float32"]) if floor is None else floor)
        extra = rules[i] if rules is not None else []
        c = compare_tensor(t, anchor, rtol=0.0, atol=bound, rules=extra, fast="fp64-anchored", in_float64=True)
        c.message = c.message and (f"{c.message} (fp64-anchored: reference {name} error {ref_err:.3g}, "
                                   f"factor {factor:g}, floor {bound - factor * ref_err:g})")
        results.append(c)
    return merge(results)
