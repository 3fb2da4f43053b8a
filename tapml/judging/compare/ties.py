"""Index outputs that may order equal values any way (sort, topk, kthvalue, mode)."""

from __future__ import annotations

import torch


#: Ops whose index output may order equal values any way (torch leaves the order of ties
#: unspecified): ``op -> (position of dim in args, its default)``. ``sort.stable`` with
#: ``stable=True`` is not one of them: its ties must come in input order. kthvalue (a quickselect),
#: mode (an unstable sort) and nanmedian (of an all-NaN row) pick any index of equal values.
TIE_ORDERED = {"aten.sort.default": (1, -1), "aten.sort.stable": (None, -1), "aten.topk.default": (2, -1),
               "aten.kthvalue.default": (2, -1), "aten.mode.default": (1, -1), "aten.nanmedian.dim": (1, -1)}


def tie_dim(op: str, args: list, kwargs: dict) -> int | None:
    """The dim along which ``op`` (a :data:`TIE_ORDERED` op, else None) may order ties freely."""
    if op not in TIE_ORDERED or (op == "aten.sort.stable" and kwargs.get("stable")):
        return None
    pos, default = TIE_ORDERED[op]
    dim = args[pos] if pos is not None and len(args) > pos else kwargs.get("dim", default)
    return dim if isinstance(dim, int) and not isinstance(dim, bool) else None


def indices_pick_equal_values(x: torch.Tensor, dim: int, indices: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``indices`` (a sort's or topk's index output) are a valid answer: distinct along
    ``dim`` and picking from ``x`` exactly the reference's ``values`` (NaN matching NaN). So an
    index output that differs from the reference only in the order of equal values passes."""
    if indices.shape != values.shape or indices.dtype not in (torch.int64, torch.int32) or x.dim() == 0:
        return False
    if indices.dim() == x.dim() - 1:  # a reduction without keepdim: one index per row
        dim = dim % x.dim()
        indices, values = indices.unsqueeze(dim), values.unsqueeze(dim)
    size = x.shape[dim]
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= size):
        return False
    picked = x.gather(dim, indices.to(torch.int64))
    same = (picked == values) | (picked.isnan() & values.isnan()) if values.is_floating_point() else picked == values
    if not bool(same.all()):
        return False
    ordered = indices.sort(dim).values  # distinct: no index twice in a row
    return not bool((ordered.narrow(dim, 1, max(0, ordered.shape[dim] - 1)) ==
                     ordered.narrow(dim, 0, max(0, ordered.shape[dim] - 1))).any())

