"""Data-dependent arguments of reference ops, checked before torch runs the op.

Some CPU kernels of the op vocabulary (:mod:`tapml.ops`) take positions, offsets, lengths or
sizes from their tensor arguments and trust them: ``max_pool2d_with_indices_backward`` writes
``grad_input[indices[i]] += grad_output[i]`` with no bounds check, ``_unsafe_index`` reads where
its indices say, ``ctc_loss`` walks its targets. A store, a ``.pt2`` or a client of a reference
server may hold any values there. :func:`check_call` holds every such argument to the range the
op documents before the op runs, and :data:`BOUNDS` names the op packets it knows; an op whose
values cannot be checked is refused by the vocabulary instead (``tapml.ops``: sparse
constructors, quantized and packed-weight ops, packed-sequence RNNs, ``segment_reduce``).

Which tensor arguments hold such values is decided by name over the whole vocabulary:
:data:`INDEX_ARGUMENTS` (positions, offsets, lengths, targets) and :data:`VALUE_ARGUMENTS`
(everything else). tests/test_op_bounds.py walks every op of the vocabulary and fails when a
name is in neither set, or an op takes an index argument and has no entry in :data:`BOUNDS`.

Ops whose output size depends on the data (``bincount``, ``one_hot``, ``repeat_interleave``) are
held to a byte budget too (:func:`memory_budget`).

Example::

    check_call("aten.gather.default", (x, 1, idx), {})   # OutOfBounds: ... index holds 7 ...
"""

from __future__ import annotations

import math
from typing import Any, Callable


class OutOfBounds(ValueError):
    """An op's data-dependent argument (an index, offset, length or size) is outside what the op accepts."""


#: Tensor arguments whose values a kernel uses as positions, offsets, lengths, counts or class targets.
INDEX_ARGUMENTS = frozenset({
    "index", "indices", "target", "targets", "offsets", "lengths", "input_lengths", "target_lengths",
    "batch_sizes", "pivots", "LU_pivots", "sorter", "repeats", "tensor_indices_or_sections",
    "random_samples", "crow_indices", "col_indices", "ccol_indices", "row_indices", "compressed_indices",
    "plain_indices", "packed", "packed_weight", "packed_ih", "packed_hh", "col_offsets", "col_offsets_ih",
    "col_offsets_hh", "qtensor", "qtensors",
})

#: Tensor arguments whose values no kernel uses to address memory (data, weights, statistics,
#: float targets of regression losses are listed under INDEX_ARGUMENTS' ``target`` and told apart
#: by dtype). Audited over torch's vocabulary; tests/test_op_bounds.py keeps it complete.
VALUE_ARGUMENTS = frozenset({
    "self", "input", "weight", "other", "grad_output", "bias", "x", "hx", "n", "tensors", "A", "grad",
    "running_mean", "running_var", "values", "params", "src", "data", "mat2", "mean", "mask", "w_ih", "w_hh",
    "b_ih", "b_hh", "grad_out", "output", "y", "source", "value", "B", "end", "input2", "mat1", "invstd",
    "condition", "scale", "zero_point", "per_sample_weights", "log_probs", "save_mean", "x1", "x2", "exponent",
    "window", "grad_hy", "grad_cy", "save_var", "query", "key", "vec2", "input1", "max", "min", "batch1",
    "batch2", "z", "bins", "v", "noise", "the_template", "count", "cx", "dropout_state", "reserve", "theta",
    "dx", "scales", "zero_points", "elements", "test_elements", "total_weight", "weight1", "weight2", "weight3",
    "hx_", "attn_mask", "atol", "rtol", "spacing", "q", "LU_data", "tensor1", "tensor2", "sorted_sequence",
    "vec", "std", "high", "rstd", "boundaries", "outputs", "inputs", "grad_outputs", "flat", "sequences",
    "grad_y", "z_state", "cell_state_fwd", "layersOutputs", "sum_dy", "sum_dy_xmu", "counts", "weight_buf",
    "var", "i1", "i2", "i3", "glu", "g", "grad_x", "grad_glu", "dgrad_glu", "is_target", "weight4", "cx_tmp",
    "hy_", "cy_", "workspace", "weights", "LD", "grad_in", "rcond", "self_or_result", "real", "imag", "prob",
    "b", "tau", "abs", "angle", "weight0", "cx_", "tol", "fweights", "aweights", "attn_bias", "tensor",
    "input3", "buffer", "pos_weight", "vec1", "p", "prepend", "append", "mat", "a", "matrices", "anchor",
    "positive", "negative", "LU", "save_invstd", "reserveSpace", "start", "grid",
})

#: Ops whose ``target`` is a value to match (regression and margin losses), not a class index.
VALUE_TARGET_OPS = frozenset({
    f"aten.{n}" for n in ("binary_cross_entropy", "binary_cross_entropy_backward", "binary_cross_entropy_with_logits",
                          "mse_loss", "mse_loss_backward", "l1_loss", "huber_loss", "huber_loss_backward",
                          "smooth_l1_loss", "smooth_l1_loss_backward", "soft_margin_loss", "soft_margin_loss_backward",
                          "kl_div", "margin_ranking_loss", "hinge_embedding_loss", "cosine_embedding_loss",
                          "poisson_nll_loss")})

_INT_DTYPES = None


def _is_int(t) -> bool:
    import torch
    global _INT_DTYPES
    if _INT_DTYPES is None:
        _INT_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
    return isinstance(t, torch.Tensor) and t.dtype in _INT_DTYPES


def _tensor(t) -> bool:
    import torch
    return isinstance(t, torch.Tensor)


def _ints(b: dict, key: str, *, optional: bool = False):
    """The integer tensor argument ``key`` (None when optional and absent); OutOfBounds otherwise."""
    t = b.get(key)
    if t is None and optional:
        return None
    if not _is_int(t):
        kind = f"a {t.dtype} tensor" if _tensor(t) else type(t).__name__
        raise OutOfBounds(f"argument {key!r} must be a tensor of integers, not {kind}")
    return t


def _extremes(t) -> tuple[int, int] | None:
    if t.numel() == 0:
        return None
    if t.device.type == "meta":
        raise OutOfBounds("index values on the meta device cannot be checked")
    return int(t.min()), int(t.max())


def _within(t, lo: int, hi: int, what: str, why: str) -> None:
    """Every value of integer tensor ``t`` in [lo, hi)."""
    ext = _extremes(t)
    if ext is None:
        return
    mn, mx = ext
    if mn < lo or mx >= hi:
        bad = mn if mn < lo else mx
        raise OutOfBounds(f"{what} holds {bad}, outside [{lo}, {hi}) ({why})")


def _dim(dim, ndim: int, what: str = "dim") -> int:
    n = max(ndim, 1)
    if type(dim) is not int or not -n <= dim < n:
        raise OutOfBounds(f"{what} {dim!r} is not a dimension of a {ndim}-d tensor")
    return dim % n


def _size(t, dim: int) -> int:
    return t.shape[dim] if t.dim() else 1


#: env: the memory budget in MiB (:func:`memory_budget`)
BUDGET_ENV = "TAPML_MEMORY_BUDGET_MIB"


def memory_budget() -> int:
    """Bytes one tensor a reference op computes may take: ``$TAPML_MEMORY_BUDGET_MIB`` MiB, or half of
    the machine's physical memory. ValueError for a value that is not a positive number of MiB."""
    import os
    text = os.environ.get(BUDGET_ENV)
    if text:
        try:
            mib = int(text)
        except ValueError:
            mib = 0
        if mib <= 0:
            raise ValueError(f"{BUDGET_ENV}={text[:40]!r}: give a positive number of MiB")
        return mib << 20
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 8 << 30


def _budget_elements(count: int, itemsize: int, what: str) -> None:
    budget = memory_budget()
    if count < 0 or count * itemsize > budget:
        raise OutOfBounds(f"{what} would be {count} elements ({count * itemsize} bytes), over the memory budget of "
                          f"{budget} bytes (TAPML_MEMORY_BUDGET_MIB)")


# --- checks by family ----------------------------------------------------------------------

def _along_dim(b: dict) -> None:
    """gather / scatter family: ``index`` has the rank of ``self`` and values in [0, size(dim))."""
    self, index = b.get("self"), _ints(b, "index")
    if not _tensor(self):
        raise OutOfBounds("argument 'self' must be a tensor")
    dim = _dim(b.get("dim"), self.dim())
    if index.numel() == 0:
        return
    if max(index.dim(), 1) != max(self.dim(), 1):
        raise OutOfBounds(f"index has {index.dim()} dimensions, self {self.dim()}; they must be the same")
    src = b.get("src")
    for d in range(index.dim()):
        if d != dim and index.shape[d] > _size(self, d):
            raise OutOfBounds(f"index size {index.shape[d]} at dimension {d} exceeds self's {_size(self, d)}")
        if _tensor(src) and src.dim() == index.dim() and index.shape[d] > src.shape[d]:
            raise OutOfBounds(f"index size {index.shape[d]} at dimension {d} exceeds src's {src.shape[d]}")
    _within(index, 0, _size(self, dim), "index", f"dimension {dim} of self has size {_size(self, dim)}")


def _gather_backward(b: dict) -> None:
    """gather_backward scatters ``grad`` into a tensor like ``self`` along ``index``."""
    _along_dim({**b, "src": b.get("grad")})


def _index_1d(negative: bool, self_key: str = "self") -> Callable[[dict], None]:
    """index_select / index_add / index_copy / index_fill / index_reduce: a 0-d or 1-d index into ``dim``."""
    def check(b: dict) -> None:
        self, index = b.get(self_key), _ints(b, "index")
        if not _tensor(self):
            raise OutOfBounds(f"argument {self_key!r} must be a tensor")
        if index.dim() > 1:
            raise OutOfBounds(f"index must be 0-d or 1-d, not {index.dim()}-d")
        dim = _dim(b.get("dim"), self.dim())
        size = _size(self, dim)
        _within(index, -size if negative else 0, size, "index", f"dimension {dim} has size {size}")
    return check


def _index_select_backward(b: dict) -> None:
    sizes, index = b.get("self_sizes"), _ints(b, "index")
    if not isinstance(sizes, (list, tuple)) or not all(type(s) is int and s >= 0 for s in sizes):
        raise OutOfBounds("self_sizes must be a list of sizes")
    dim = _dim(b.get("dim"), len(sizes))
    size = sizes[dim] if sizes else 1
    _within(index, 0, size, "index", f"dimension {dim} has size {size}")


def _advanced_index(b: dict) -> None:
    """index / _unsafe_index / index_put: each index tensor addresses the next dimensions of ``self``."""
    import torch
    self, indices = b.get("self"), b.get("indices")
    if not _tensor(self) or not isinstance(indices, (list, tuple)):
        raise OutOfBounds("index needs a tensor and a list of index tensors")
    d = 0
    for i, idx in enumerate(indices):
        if idx is None:
            d += 1
            continue
        if not _tensor(idx):
            raise OutOfBounds(f"indices[{i}] must be a tensor or None")
        if idx.dtype in (torch.bool, torch.uint8):
            shape = tuple(self.shape[d:d + idx.dim()])
            if tuple(idx.shape) != shape:
                raise OutOfBounds(f"indices[{i}] is a mask of shape {list(idx.shape)}; it must match self's dimensions "
                                  f"{d}..{d + idx.dim() - 1} of shape {list(shape)}")
            d += idx.dim()
            continue
        if not _is_int(idx):
            raise OutOfBounds(f"indices[{i}] must hold integers or booleans, not {idx.dtype}")
        if d >= max(self.dim(), 1):
            raise OutOfBounds(f"too many indices for a {self.dim()}-d tensor")
        size = _size(self, d)
        _within(idx, -size, size, f"indices[{i}]", f"dimension {d} has size {size}")
        d += 1
    if d > max(self.dim(), 1):
        raise OutOfBounds(f"too many indices for a {self.dim()}-d tensor")


def _take(b: dict) -> None:
    self, index = b.get("self"), _ints(b, "index")
    n = self.numel()
    _within(index, -n, n, "index", f"self has {n} elements")


def _take_along_dim(b: dict) -> None:
    self, indices = b.get("self"), _ints(b, "indices")
    if b.get("dim") is None:
        _within(indices, 0, self.numel(), "indices", f"self has {self.numel()} elements")
        return
    dim = _dim(b.get("dim"), self.dim())
    _within(indices, 0, _size(self, dim), "indices", f"dimension {dim} has size {_size(self, dim)}")


def _rows(weight_key: str = "weight", count_key: str | None = None) -> Callable[[dict], None]:
    """embedding family: indices pick rows of ``weight`` (or ``count_key`` of them)."""
    def check(b: dict) -> None:
        indices = _ints(b, "indices")
        if count_key is not None:
            rows = b.get(count_key)
            if type(rows) is not int or rows < 0:
                raise OutOfBounds(f"{count_key} must be a count >= 0")
        else:
            weight = b.get(weight_key)
            if not _tensor(weight) or weight.dim() < 1:
                raise OutOfBounds(f"{weight_key} must be a tensor with rows")
            rows = weight.shape[0]
        _within(indices, 0, rows, "indices", f"there are {rows} rows")
    return check


def _embedding_bag(b: dict) -> None:
    _rows()(b)
    indices, offsets, weight = b["indices"], b.get("offsets"), b["weight"]
    mode = b.get("mode", 0)
    if type(mode) is not int or mode not in (0, 1, 2):
        raise OutOfBounds(f"mode {mode!r} is not 0 (sum), 1 (mean) or 2 (max)")
    psw = b.get("per_sample_weights")
    if psw is not None and (not _tensor(psw) or tuple(psw.shape) != tuple(indices.shape)):
        raise OutOfBounds("per_sample_weights must have the shape of indices")
    padding_idx = b.get("padding_idx")
    if padding_idx is not None and (type(padding_idx) is not int or not -weight.shape[0] - 1 <= padding_idx < weight.shape[0]):
        raise OutOfBounds(f"padding_idx {padding_idx!r} is not a row of weight")
    if indices.dim() == 2:
        if offsets is not None and offsets.numel():
            raise OutOfBounds("2-d indices take no offsets")
        return
    if indices.dim() != 1:
        raise OutOfBounds(f"indices must be 1-d or 2-d, not {indices.dim()}-d")
    offsets = _ints(b, "offsets")
    if offsets.dim() != 1:
        raise OutOfBounds(f"offsets must be 1-d, not {offsets.dim()}-d")
    if offsets.numel() == 0:
        raise OutOfBounds("offsets must hold at least one bag start")
    if int(offsets[0]) != 0:
        raise OutOfBounds(f"offsets must start at 0, not {int(offsets[0])}")
    _within(offsets, 0, indices.numel() + 1, "offsets", f"there are {indices.numel()} indices")
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        raise OutOfBounds("offsets must not decrease")


def _pooled(spatial: int | None, grad_key: str = "grad_output") -> Callable[[dict], None]:
    """Pooling backward with indices: ``indices`` has the grad's shape and points into one
    plane of ``self`` (its last ``spatial`` dimensions)."""
    def check(b: dict) -> None:
        self, indices, grad = b.get("self"), _ints(b, "indices"), b.get(grad_key)
        if not _tensor(self) or not _tensor(grad):
            raise OutOfBounds(f"self and {grad_key} must be tensors")
        if tuple(indices.shape) != tuple(grad.shape):
            raise OutOfBounds(f"indices has shape {list(indices.shape)}, {grad_key} {list(grad.shape)}; they must match")
        dims = spatial if spatial is not None else max(self.dim() - 2, 1)
        if self.dim() < dims:
            raise OutOfBounds(f"self has {self.dim()} dimensions; the pooling works on {dims}")
        plane = math.prod(self.shape[self.dim() - dims:])
        _within(indices, 0, plane, "indices", f"one input plane has {plane} elements")
    return check


def _fractional_samples(spatial: int) -> Callable[[dict], None]:
    def check(b: dict) -> None:
        self, samples = b.get("self"), b.get("random_samples")
        if not _tensor(samples) or not samples.is_floating_point() or samples.dim() != 3 or samples.shape[-1] != spatial:
            raise OutOfBounds(f"random_samples must be a float tensor of shape [N, C, {spatial}]")
        batch = self.shape[0] if self.dim() == spatial + 2 else 1
        channels = self.shape[-spatial - 1]
        if samples.shape[0] < batch or samples.shape[1] < channels:
            raise OutOfBounds(f"random_samples of shape {list(samples.shape)} does not cover {batch} x {channels} planes")
        if samples.numel() and not bool(((samples >= 0) & (samples < 1)).all()):
            raise OutOfBounds("random_samples must lie in [0, 1)")
    return check


def _unpool(spatial: int) -> Callable[[dict], None]:
    def check(b: dict) -> None:
        self, indices, size = b.get("self"), _ints(b, "indices"), b.get("output_size")
        if not _tensor(self) or tuple(indices.shape) != tuple(self.shape):
            raise OutOfBounds("indices must have the shape of self")
        if not isinstance(size, (list, tuple)) or len(size) != spatial or not all(type(s) is int and s >= 0 for s in size):
            raise OutOfBounds(f"output_size must be {spatial} sizes")
        plane = math.prod(size)
        _within(indices, 0, plane, "indices", f"one output plane has {plane} elements")
    return check


def _sizes_dim(indices_key: str, sizes_key: str) -> Callable[[dict], None]:
    """value_selecting_reduction_backward: indices along ``dim`` of a tensor of ``sizes``."""
    def check(b: dict) -> None:
        sizes, indices = b.get(sizes_key), _ints(b, indices_key)
        if not isinstance(sizes, (list, tuple)) or not all(type(s) is int and s >= 0 for s in sizes):
            raise OutOfBounds(f"{sizes_key} must be a list of sizes")
        dim = _dim(b.get("dim"), len(sizes))
        size = sizes[dim] if sizes else 1
        _within(indices, 0, size, indices_key, f"dimension {dim} has size {size}")
    return check


def _cummaxmin_backward(b: dict) -> None:
    inp, indices = b.get("input"), _ints(b, "indices")
    dim = _dim(b.get("dim"), inp.dim())
    if tuple(indices.shape) != tuple(inp.shape):
        raise OutOfBounds("indices must have the shape of input")
    _within(indices, 0, _size(inp, dim), "indices", f"dimension {dim} has size {_size(inp, dim)}")


def _classes(self_key: str = "self", low: int = 0) -> Callable[[dict], None]:
    """Class-index targets (nll_loss, cross_entropy, multi_margin, multilabel_margin): values in
    [low, C) or ``ignore_index``; a floating target (probabilities) is not an index."""
    def check(b: dict) -> None:
        self, target = b.get(self_key), b.get("target")
        if not _tensor(self) or not _tensor(target):
            raise OutOfBounds(f"{self_key} and target must be tensors")
        if target.is_floating_point():
            return
        _ints(b, "target")
        classes = self.shape[1] if self.dim() >= 2 else (self.shape[0] if self.dim() == 1 else 1)
        weight = b.get("weight")
        if _tensor(weight) and weight.numel() != classes:
            raise OutOfBounds(f"weight has {weight.numel()} elements for {classes} classes")
        expected = tuple(self.shape[:1]) + tuple(self.shape[2:]) if self.dim() >= 2 else ()
        if low < 0:  # multilabel: target has the input's shape
            expected = tuple(self.shape)
        if tuple(target.shape) != expected and not (self.dim() == 1 and target.numel() == 1 and low >= 0):
            raise OutOfBounds(f"target has shape {list(target.shape)}; the input of shape {list(self.shape)} "
                              f"wants {list(expected)}")
        ignore = b.get("ignore_index")
        check_values = target if type(ignore) is not int else target[target != ignore]
        _within(check_values, low, classes, "target", f"there are {classes} classes")
    return check


def _ctc(b: dict) -> None:
    log_probs, targets = b.get("log_probs"), _ints(b, "targets")
    if not _tensor(log_probs) or log_probs.dim() not in (2, 3):
        raise OutOfBounds("log_probs must be a [T, N, C] or [T, C] tensor")
    steps, classes = log_probs.shape[0], log_probs.shape[-1]
    batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
    blank = b.get("blank", 0)
    if type(blank) is not int or not 0 <= blank < classes:
        raise OutOfBounds(f"blank {blank!r} is not a class of {classes}")

    def lengths(key: str) -> list[int]:
        value = b.get(key)
        if _tensor(value):
            value = _ints(b, key)
            if value.dim() > 1:
                raise OutOfBounds(f"{key} must be 0-d or 1-d")
            value = [int(v) for v in value.reshape(-1)]
        if not isinstance(value, (list, tuple)) or not all(type(v) is int for v in value):
            raise OutOfBounds(f"{key} must be a list of lengths")
        if len(value) != batch:
            raise OutOfBounds(f"{key} has {len(value)} entries for a batch of {batch}")
        return list(value)

    input_lengths, target_lengths = lengths("input_lengths"), lengths("target_lengths")
    for v in input_lengths:
        if not 0 <= v <= steps:
            raise OutOfBounds(f"input_lengths holds {v}, outside [0, {steps}] (log_probs has {steps} steps)")
    if any(v < 0 for v in target_lengths):
        raise OutOfBounds(f"target_lengths holds {min(target_lengths)}, below 0")
    if targets.dim() == 2:
        if targets.shape[0] < batch or any(v > targets.shape[1] for v in target_lengths):
            raise OutOfBounds(f"targets of shape {list(targets.shape)} hold fewer than target_lengths "
                              f"{target_lengths[:8]} for a batch of {batch}")
    elif targets.dim() == 1:
        if sum(target_lengths) > targets.numel():
            raise OutOfBounds(f"target_lengths sum to {sum(target_lengths)}; targets hold {targets.numel()}")
    else:
        raise OutOfBounds(f"targets must be 1-d or 2-d, not {targets.dim()}-d")
    _within(targets, 0, classes, "targets", f"log_probs has {classes} classes")


def _searchsorted(b: dict) -> None:
    seq, sorter = b.get("sorted_sequence"), b.get("sorter")
    if sorter is None:
        return
    sorter = _ints(b, "sorter")
    if not _tensor(seq) or tuple(sorter.shape) != tuple(seq.shape):
        raise OutOfBounds("sorter must have the shape of sorted_sequence")
    n = _size(seq, seq.dim() - 1) if seq.dim() else 1
    _within(sorter, 0, n, "sorter", f"the sequence has {n} elements")


def _bincount(b: dict) -> None:
    self = _ints(b, "self")
    if self.dim() != 1:
        raise OutOfBounds(f"bincount takes a 1-d tensor, not {self.dim()}-d")
    minlength = b.get("minlength", 0)
    if type(minlength) is not int or minlength < 0:
        raise OutOfBounds(f"minlength {minlength!r} must be >= 0")
    weights = b.get("weights")
    if weights is not None and (not _tensor(weights) or tuple(weights.shape) != tuple(self.shape)):
        raise OutOfBounds("weights must have the shape of self")
    ext = _extremes(self)
    if ext is not None and ext[0] < 0:
        raise OutOfBounds(f"self holds {ext[0]}; bincount counts values >= 0")
    _budget_elements(max(minlength, (ext[1] + 1) if ext else 0), 8, "bincount's output")


def _one_hot(b: dict) -> None:
    self = _ints(b, "self")
    classes = b.get("num_classes", -1)
    if type(classes) is not int or classes < -1:
        raise OutOfBounds(f"num_classes {classes!r} must be -1 or a count")
    ext = _extremes(self)
    if classes == -1:
        classes = (ext[1] + 1) if ext else 0
    _within(self, 0, max(classes, 0), "self", f"there are {classes} classes")
    _budget_elements(self.numel() * classes, 8, "one_hot's output")


def _repeats(b: dict) -> None:
    """repeat_interleave: repeats >= 0, one per element (or one for all), and the repeated length
    (what ``output_size`` must say when given) within the budget."""
    repeats = _ints(b, "repeats")
    if repeats.dim() > 1:
        raise OutOfBounds(f"repeats must be 0-d or 1-d, not {repeats.dim()}-d")
    ext = _extremes(repeats)
    if ext is not None and ext[0] < 0:
        raise OutOfBounds(f"repeats holds {ext[0]}; repeats must be >= 0")
    self, size = b.get("self"), b.get("output_size")
    if self is None:  # repeat_interleave(repeats): the indices, repeated
        length, row = int(repeats.sum()), 8
    else:
        dim = b.get("dim")
        n = self.numel() if dim is None else _size(self, _dim(dim, self.dim()))
        if repeats.numel() not in (1, n):
            raise OutOfBounds(f"repeats has {repeats.numel()} entries for {n} elements")
        length = int(repeats.sum()) * (n if repeats.numel() == 1 else 1)
        row = self.element_size() * (self.numel() // max(n, 1) if dim is not None else 1)
    if size is not None and size != length:
        raise OutOfBounds(f"output_size {size!r} is not the repeated length, {length}")
    _budget_elements(length, row, "repeat_interleave's output")


def _split_points(b: dict) -> None:
    t = _ints(b, "tensor_indices_or_sections")
    if t.dim() > 1:
        raise OutOfBounds("tensor_indices_or_sections must be 0-d or 1-d")


def _narrow_start(b: dict) -> None:
    self, start, length = b.get("self"), _ints(b, "start"), b.get("length")
    if start.numel() != 1:
        raise OutOfBounds("start must hold one value")
    dim = _dim(b.get("dim"), self.dim())
    size = _size(self, dim)
    s = int(start.reshape(()))
    s = s + size if s < 0 else s
    if type(length) is not int or not 0 <= s <= size or length < 0 or s + length > size:
        raise OutOfBounds(f"start {int(start.reshape(()))} and length {length!r} leave dimension {dim} of size {size}")


def _pivots(key: str, lu_key: str, signed: bool = False) -> Callable[[dict], None]:
    """LU / LDL pivots: 1-based row numbers in [1, n] (LDL's may be negative: -n..-1 too)."""
    def check(b: dict) -> None:
        lu, pivots = b.get(lu_key), _ints(b, key)
        if not _tensor(lu) or lu.dim() < 2:
            raise OutOfBounds(f"{lu_key} must be a (batch of) matrix")
        k = min(lu.shape[-2], lu.shape[-1])
        if tuple(pivots.shape) != tuple(lu.shape[:-2]) + (k,):
            raise OutOfBounds(f"{key} has shape {list(pivots.shape)}; {lu_key} of shape {list(lu.shape)} wants "
                              f"{list(lu.shape[:-2]) + [k]}")
        rows = lu.shape[-2]
        if signed:
            _within(pivots.abs(), 1, rows + 1, key, f"pivots are row numbers 1..{rows} (or their negatives)")
        else:
            _within(pivots, 1, rows + 1, key, f"pivots are row numbers 1..{rows}")
    return check


def _strided(scatter: bool = False) -> Callable[[dict], None]:
    """as_strided family: sizes, strides and offset must stay inside ``self``'s storage (for
    ``as_strided_scatter``, inside the fresh copy of ``self`` it writes into)."""
    def check(b: dict) -> None:
        self, size, stride = b.get("self"), b.get("size"), b.get("stride")
        offset = b.get("storage_offset")
        if not _tensor(self):
            raise OutOfBounds("self must be a tensor")
        if not isinstance(size, (list, tuple)) or not isinstance(stride, (list, tuple)) or len(size) != len(stride) \
                or not all(type(s) is int and s >= 0 for s in (*size, *stride)):
            raise OutOfBounds("size and stride must be lists of the same length of integers >= 0")
        base = (0 if scatter else self.storage_offset()) if offset is None else offset
        if type(base) is not int or base < 0:
            raise OutOfBounds(f"storage_offset {offset!r} must be >= 0")
        if 0 in size:
            return
        last = base + sum((s - 1) * st for s, st in zip(size, stride))
        if scatter or self.device.type == "meta":
            elements = self.numel() + (0 if scatter else self.storage_offset())
        else:
            elements = self.untyped_storage().nbytes() // self.element_size()
        if last >= elements:
            raise OutOfBounds(f"size {list(size)} with stride {list(stride)} from offset {base} reaches element "
                              f"{last}; {'the copy of self' if scatter else 'the storage of self'} holds {elements}")
    return check


def _segments(b: dict) -> None:
    """segment_reduce: lengths (>= 0, summing to the axis) or offsets (from 0, not decreasing, up to it)."""
    data = b.get("data")
    if not _tensor(data):
        raise OutOfBounds("data must be a tensor")
    axis = _dim(b.get("axis", 0), data.dim(), "axis")
    size = _size(data, axis)
    if b.get("indices") is not None:
        raise OutOfBounds("indices are not accepted; give lengths or offsets")
    lengths, offsets = b.get("lengths"), b.get("offsets")
    if (lengths is None) == (offsets is None):
        raise OutOfBounds("give exactly one of lengths and offsets")
    key = "lengths" if lengths is not None else "offsets"
    t = _ints(b, key)
    if t.dim() != axis + 1 or tuple(t.shape[:axis]) != tuple(data.shape[:axis]):
        raise OutOfBounds(f"{key} of shape {list(t.shape)} does not fit data of shape {list(data.shape)} at axis {axis}")
    if key == "lengths":
        _within(t, 0, size + 1, "lengths", f"axis {axis} has size {size}")
        if t.numel() and bool((t.sum(-1) != size).any()):
            raise OutOfBounds(f"lengths must sum to {size}, the size of axis {axis}")
        return
    if t.shape[-1] < 1 or (t.numel() and bool((t[..., 0] != 0).any())):
        raise OutOfBounds("offsets must start at 0")
    _within(t, 0, size + 1, "offsets", f"axis {axis} has size {size}")
    if t.shape[-1] > 1 and bool((t[..., 1:] < t[..., :-1]).any()):
        raise OutOfBounds("offsets must not decrease")


def _grid(b: dict) -> None:
    grid = b.get("grid")
    if not _tensor(grid) or not grid.is_floating_point():
        raise OutOfBounds("grid must be a floating tensor")
    for key, count in (("interpolation_mode", 3), ("padding_mode", 3)):
        v = b.get(key)
        if type(v) is not int or not 0 <= v < count:
            raise OutOfBounds(f"{key} {v!r} is not one of 0..{count - 1}")
    if grid.numel() and not bool(grid.isfinite().all()):
        raise OutOfBounds("grid holds NaN or infinity")


#: Op packet (``aten.NAME``) -> the check of its data-dependent arguments (a dict of the call's
#: arguments by schema name, defaults filled in). Every overload of a packet in the vocabulary uses it.
BOUNDS: dict[str, Callable[[dict], None]] = {
    **{f"aten.{n}": _along_dim for n in ("gather", "scatter", "scatter_add", "scatter_reduce")},
    "aten.gather_backward": _gather_backward,
    **{f"aten.{n}": _index_1d(False) for n in ("index_select", "index_add", "index_copy", "index_reduce")},
    "aten.index_fill": _index_1d(True),
    "aten.index_select_backward": _index_select_backward,
    **{f"aten.{n}": _advanced_index for n in ("index", "_unsafe_index", "index_put")},
    "aten.take": _take, "aten.put": _take,
    "aten.take_along_dim": _take_along_dim,
    "aten.embedding": _rows(), "aten.embedding_renorm": _rows("self"),
    "aten.embedding_backward": _rows(count_key="num_weights"),
    "aten.embedding_dense_backward": _rows(count_key="num_weights"),
    **{f"aten.{n}": _embedding_bag for n in ("embedding_bag", "_embedding_bag", "_embedding_bag_forward_only")},
    "aten.max_pool2d_with_indices_backward": _pooled(2), "aten.max_pool3d_with_indices_backward": _pooled(3),
    "aten.adaptive_max_pool2d_backward": _pooled(2), "aten.adaptive_max_pool3d_backward": _pooled(3),
    "aten.fractional_max_pool2d_backward": _pooled(2), "aten.fractional_max_pool3d_backward": _pooled(3),
    "aten.fractional_max_pool2d": _fractional_samples(2), "aten.fractional_max_pool3d": _fractional_samples(3),
    "aten.max_unpool2d": _unpool(2), "aten.max_unpool3d": _unpool(3),
    "aten.value_selecting_reduction_backward": _sizes_dim("indices", "sizes"),
    "aten.cummaxmin_backward": _cummaxmin_backward,
    **{f"aten.{n}": _classes() for n in ("nll_loss", "nll_loss_nd", "nll_loss2d", "nll_loss_forward",
                                         "nll_loss2d_forward", "cross_entropy_loss", "multi_margin_loss")},
    **{f"aten.{n}": _classes() for n in ("nll_loss_backward", "nll_loss2d_backward", "multi_margin_loss_backward")},
    **{f"aten.{n}": _classes(low=-1) for n in ("multilabel_margin_loss", "multilabel_margin_loss_forward",
                                               "multilabel_margin_loss_backward")},
    "aten.ctc_loss": _ctc,
    "aten.searchsorted": _searchsorted,
    "aten.bincount": _bincount,
    "aten.one_hot": _one_hot,
    "aten.repeat_interleave": _repeats,
    "aten.tensor_split": _split_points,
    "aten.narrow": _narrow_start,
    "aten.lu_unpack": _pivots("LU_pivots", "LU_data"), "aten.lu_solve": _pivots("LU_pivots", "LU_data"),
    "aten.linalg_lu_solve": _pivots("pivots", "LU"), "aten.linalg_ldl_solve": _pivots("pivots", "LD", signed=True),
    "aten.as_strided": _strided(), "aten.as_strided_copy": _strided(), "aten.as_strided_scatter": _strided(scatter=True),
    "aten.segment_reduce": _segments,
    **{f"aten.{n}": _grid for n in ("grid_sampler", "grid_sampler_2d", "grid_sampler_3d", "grid_sampler_2d_backward",
                                    "grid_sampler_3d_backward")},
}

#: Ops whose positions, counts or sizes come in arguments not named in INDEX_ARGUMENTS (``self``
#: of bincount and one_hot, narrow's ``start``, as_strided's sizes and strides, grid sampling modes).
OTHER_INDEX_OPS = frozenset({"aten.bincount", "aten.one_hot", "aten.repeat_interleave", "aten.narrow", "aten.as_strided",
                             "aten.as_strided_copy", "aten.as_strided_scatter", "aten.grid_sampler",
                             "aten.grid_sampler_2d", "aten.grid_sampler_3d", "aten.grid_sampler_2d_backward",
                             "aten.grid_sampler_3d_backward", "aten.segment_reduce"})


def bind(op, args, kwargs) -> dict[str, Any]:
    """The arguments of a call of OpOverload ``op`` by schema name, defaults filled in."""
    params = op._schema.arguments
    bound = {p.name: v for p, v in zip(params, args)}
    bound.update(kwargs)
    for p in params:
        if p.name not in bound and p.has_default_value():
            bound[p.name] = p.default_value
    return bound


def check_call(op_name: str, args, kwargs) -> None:
    """Raise :class:`OutOfBounds` (saying which argument holds which value, and the range it
    must lie in) unless the data-dependent arguments of a call of ``op_name``
    (``aten.NAME.OVERLOAD``, already in the vocabulary) are within what its kernel accepts."""
    check = BOUNDS.get(op_name.rsplit(".", 1)[0])
    if check is None:
        return
    from tapml.ops import resolve_op
    try:
        check(bind(resolve_op(op_name), args, kwargs))
    except OutOfBounds as e:
        raise OutOfBounds(f"{op_name}: {e}") from None
    except (TypeError, IndexError, AttributeError, RuntimeError) as e:
        raise OutOfBounds(f"{op_name}: its arguments do not fit the op ({type(e).__name__}: {str(e)[:200]})") from None


__all__ = ["BUDGET_ENV", "memory_budget", "BOUNDS", "INDEX_ARGUMENTS", "VALUE_ARGUMENTS", "OTHER_INDEX_OPS", "VALUE_TARGET_OPS", "OutOfBounds", "bind", "check_call"]
