"""Comparison of target outputs with the reference: the one place tolerances and error bounds live.

- :mod:`tapml.judging.compare.values`: shapes, dtypes, then values: the tolerances (the fast path),
  the int64 policy, error statistics, and :class:`Rule`, a further way an element may pass.
- :mod:`tapml.judging.compare.anchored`: fp64-anchored judging (a target's error against float64 within
  a factor of the reference's own): low-precision ops, and float32 regions and whole models.
- :mod:`tapml.judging.compare.bounds`: the arithmetic bound of accumulating ops (sums of products,
  norms, softmax): the error a correct kernel's rounding can make, from the reduction length.
- :mod:`tapml.judging.compare.ties`: index outputs that may order equal values any way.
- :mod:`tapml.judging.compare.distribution`: random ops, judged by distribution.
- :mod:`tapml.judging.compare.logits`: logits judged as next-token distributions (KL, top-1 agreement).

Every public name of those modules is importable from ``tapml.judging.compare``.
"""

from tapml.judging.compare.anchored import ANCHOR_FACTOR, ANCHOR_FLOOR, anchor_bound, anchored_rule, compare_anchored
from tapml.judging.compare.bounds import ACCUMULATING, DECIDED_BY_BOUND, LAMBDA, UNIT_ROUNDOFF, accumulates, arithmetic_bounds, growth
from tapml.judging.compare.distribution import (KS_CONSTANT, NORMAL_ARGUMENTS, RANDOM_NOTE, RANDOM_OPS, RANDOM_PACKETS, SIGMAS,
                                        compare_distribution, is_random_op)
from tapml.judging.compare.logits import LOGITS_THRESHOLDS, agreement_note, kl_rows, logits_agreement, same_top1
from tapml.judging.compare.ties import TIE_ORDERED, indices_pick_equal_values, tie_dim
from tapml.judging.compare.values import (CHUNK, DEFAULT_TOLERANCES, I32_RANGE, INT64_OUTSIDE_I32, 
                                  UNINITIALIZED_NOTE, UNINITIALIZED_PACKETS, Comparison, Rule, Tolerances,
                                  compare_metadata, compare_outputs, compare_tensor, first_outside_i32,
                                  float_model_note, is_uninitialized_op, merge, metadata_mismatch, outside_i32)

__all__ = ["ANCHOR_FACTOR", "ANCHOR_FLOOR", "anchor_bound", "anchored_rule", "compare_anchored", "ACCUMULATING", "DECIDED_BY_BOUND",
           "LAMBDA", "UNIT_ROUNDOFF", "accumulates", "arithmetic_bounds", "growth", "KS_CONSTANT",
           "NORMAL_ARGUMENTS", "RANDOM_NOTE", "RANDOM_OPS", "RANDOM_PACKETS", "SIGMAS", "compare_distribution",
           "is_random_op", "LOGITS_THRESHOLDS", "agreement_note", "kl_rows", "logits_agreement", "same_top1", "TIE_ORDERED", "indices_pick_equal_values", "tie_dim", "CHUNK", "DEFAULT_TOLERANCES",
           "I32_RANGE", "INT64_OUTSIDE_I32", "UNINITIALIZED_NOTE", "UNINITIALIZED_PACKETS",
           "Comparison", "Rule", "Tolerances", "compare_metadata", "compare_outputs", "compare_tensor",
           "first_outside_i32", "float_model_note", "is_uninitialized_op", "merge", "metadata_mismatch", "outside_i32"]
