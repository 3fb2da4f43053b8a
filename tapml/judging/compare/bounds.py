"""Error bounds that follow the arithmetic: how far from the float64 result an accumulating op's
output may be when the target computes it correctly in a lower precision.

A sum of ``n`` products computed in floating point with unit roundoff ``u`` (any order, any
blocking) is off by at most ``gamma_n * sum|terms|`` with ``gamma_n = n u / (1 - n u)``
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1). That worst case
needs every rounding to fall the same way; modelling roundings as independent, mean-zero and
bounded by ``u``, the error is at most ``lambda sqrt(n) u sum|terms|`` except with probability
``2 n exp(-lambda**2 (1 - u)**2 / 2)`` (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019,
Theorem 3.1). So each output element of an accumulating op may differ from its float64 value
by ``c(n) * u * M`` where ``M`` is its magnitude of terms and

    c(n) = min(n, LAMBDA * sqrt(n)),   n = reduction length + 2 (the products' and the output's roundings)

with :data:`LAMBDA` = 8: a correct kernel fails an element with probability below
``2 n e**-32`` (2e-10 for ``n`` = 8192). ``c`` comes from the reduction length alone, never
from a case. ``u`` is the unit roundoff of the output's dtype (a target that accumulates
float16 in float32 is judged by the float16 ``u``: looser, never wrongly stricter).

``M`` per op:

- sums of products (mm, bmm, addmm, addmv, baddbmm, addbmm, mv, dot, linear, matmul,
  convolution and its transpose, sum, mean, cumsum, average pools): the same op run in float64
  on ``|x|``, ``|w|`` (and ``|alpha|``, ``|beta|``): ``sum|terms|`` per output, exact.
- prod, cumprod: ``|y|`` (every product rounds once, nothing cancels).
- var, std, var_mean: ``sum(x**2) / (n - correction)``, which bounds both the two-pass and the
  one-pass formula (3 ``c``: the mean's error enters the squares twice); std as
  ``sqrt(var)``: ``min(dvar / (2 std), sqrt(dvar))`` plus its own rounding.
- softmax: ``y (c + 4 + 3 |x - max|)``: the subtraction's rounding ``u |x - max|`` grows by
  the exponential (whose WGSL accuracy is ``3 + 2 |z|`` ULP), the sum of positive terms by
  ``c``, the division by one more ``u``. log_softmax: ``2 |x - max| + |max| + |y| + c +
  4 |log S| + 16`` in absolute terms (WGSL's log is good to ``2**-21`` absolute near 1).
- layer, group and batch norm (training statistics), vector 2-norm: the error of the mean
  ``c u mean|x|`` and of the variance ``3 c u mean(x**2)`` carried through ``(x - mean) /
  sqrt(var + eps)`` to first order (see :func:`_normalized`), then ``y = x_hat w + b`` rounds
  twice more.

Ops not listed have no arithmetic bound: their outputs are judged by the tolerances (or
fp64-anchored) alone. Example::

    bounds = arithmetic_bounds("aten.mm.default", [a64, b64], {}, [a64 @ b64], "float32")
    compare_tensor(t, r, rules=[Rule("arithmetic", a64 @ b64, bounds[0])]).passed
"""

from __future__ import annotations

import math
from typing import Callable

import torch

#: Standard deviations of the probabilistic bound (Higham & Mary 2019): see the module docstring.
LAMBDA = 8.0
#: Unit roundoff ``u`` (half the machine epsilon) of each float dtype.
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def growth(n: int | float) -> float:
    """``c(n)``: how many unit roundoffs of its magnitude of terms a sum of ``n`` products may
    be off by (``n`` plus the products' and the output's own roundings; see the module docstring).
    Example: ``growth(8192)`` -> 724.1 (``8 * sqrt(8194)``); ``growth(4)`` -> 6."""
    n = max(1.0, float(n) + 2.0)
    return min(n, LAMBDA * math.sqrt(n))


def _abs_args(a):
    if isinstance(a, torch.Tensor):
        return a.abs() if a.is_floating_point() else a
    if isinstance(a, (list, tuple)):
        return type(a)(_abs_args(x) for x in a)
    if isinstance(a, float):
        return abs(a)
    return a


def _call(op: str, args, kwargs):
    from tapml.graph import resolve_op
    return resolve_op(op)(*args, **kwargs)


def _arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _prod(xs) -> int:
    return math.prod(int(x) for x in xs)


# --- sums of products: the op on absolute values --------------------------------------------

def _terms(length: Callable) -> Callable:
    """A bound for a sum of products whose reduction length is ``length(args, kwargs, out)``."""
    def bound(op, args, kwargs, outs):
        magnitude = _call(op, _abs_args(args), _abs_args(kwargs))
        magnitude = magnitude if isinstance(magnitude, torch.Tensor) else magnitude[0]
        return [growth(length(args, kwargs, outs[0])) * magnitude.double().abs()] + [None] * (len(outs) - 1)
    bound.exact_terms = True
    return bound


def _inner(args, kwargs, out) -> int:
    return int(args[0].shape[-1])


def _inner_plus_one(i: int) -> Callable:
    return lambda args, kwargs, out: int(args[i].shape[-1]) + 1


def _convolution(args, kwargs, out) -> int:
    weight, transposed = args[1], bool(_arg(args, kwargs, 6, "transposed", False))
    groups = int(_arg(args, kwargs, 8, "groups", 1))
    per_output = weight.shape[0] // groups if transposed else weight.shape[1]
    return per_output * _prod(weight.shape[2:]) + 1


def _conv(args, kwargs, out) -> int:  # conv1d/2d/3d: (input, weight, bias, ...)
    return int(args[1].shape[1]) * _prod(args[1].shape[2:]) + 1


def _conv_transpose(args, kwargs, out) -> int:  # (input, weight, bias, stride, padding, output_padding, groups, ...)
    groups = int(_arg(args, kwargs, 6, "groups", 1))
    return args[1].shape[0] // groups * _prod(args[1].shape[2:]) + 1


def _reduced(args, kwargs, out) -> int:
    return max(1, args[0].numel() // max(1, out.numel()))


def _along_dim(args, kwargs, out) -> int:
    x, dim = args[0], int(_arg(args, kwargs, 1, "dim", -1))
    return int(x.shape[dim]) if x.dim() else 1


def _pool_window(args, kwargs, out) -> int:
    kernel = _arg(args, kwargs, 1, "kernel_size")
    kernel = [kernel] if isinstance(kernel, int) else list(kernel)
    return _prod(kernel)


def _adaptive_window(args, kwargs, out) -> int:
    x, size = args[0], _arg(args, kwargs, 1, "output_size")
    size = [size] if isinstance(size, int) else list(size)
    return _prod(-(-int(x.shape[-len(size) + i]) // max(1, int(s))) + 1 for i, s in enumerate(size))


# --- products ---------------------------------------------------------------------------------

def _products(length: Callable) -> Callable:
    def bound(op, args, kwargs, outs):
        return [growth(length(args, kwargs, outs[0])) * outs[0].abs()] + [None] * (len(outs) - 1)
    return bound


# --- FFTs ---------------------------------------------------------------------------------------

def fft_growth(n: int) -> float:
    """How many unit roundoffs of ``sqrt(n) ||x||_2`` an FFT of ``n`` points may be off by, per
    output: a radix-2 FFT's norm-wise error grows like ``log2 n`` (Higham, *Accuracy and Stability*,
    §24.1: ``||X' - X|| <= log2(n) eta ||X||``, ``||X|| = sqrt(n) ||x||``, ``eta`` a few ``u`` with
    twiddles correct to ``u``): ``LAMBDA * (log2 n + 2)``; Bluestein's FFT of a length that is not a
    power of two runs three of length ``m < 4n``: three times that. Example: ``fft_growth(512)`` ->
    88, ``fft_growth(400)`` -> 264."""
    n = max(int(n), 1)
    passes = 1 if n & (n - 1) == 0 else 3
    return LAMBDA * passes * (math.ceil(math.log2(n)) + 2)


def _fft(op, args, kwargs, outs):
    """An FFT's outputs each within ``fft_growth(n) u sqrt(n) ||x||_2`` of the float64 result, the
    norm over the transformed dims, scaled as the ``normalization`` scales; ``n`` the product of the
    transform lengths. For ``_fft_c2r`` a bin standing for its conjugate twin counts twice."""
    x, dims = args[0], [int(d) % args[0].dim() for d in _arg(args, kwargs, 1, "dim")]
    norm = int(_arg(args, kwargs, 2, "normalization", 0))
    magnitude = x.abs().double() ** 2
    if op == "aten._fft_c2r.default":
        n_last = int(_arg(args, kwargs, 3, "last_dim_size"))
        last = dims[-1]
        weight = torch.full((x.shape[last],), 2.0, dtype=torch.float64)
        weight[0] = 1.0
        if n_last % 2 == 0 and n_last // 2 < x.shape[last]:
            weight[n_last // 2] = 1.0
        weight[n_last // 2 + 1:] = 0.0
        magnitude = magnitude * weight.view([-1 if d == last else 1 for d in range(x.dim())])
        n = n_last * _prod(x.shape[d] for d in dims[:-1])
    else:
        n = _prod(x.shape[d] for d in dims)
    scale = {0: 1.0, 1: 1.0 / math.sqrt(n), 2: 1.0 / n}[norm]
    total = (magnitude.sum(dim=dims, keepdim=True) * n).sqrt() * scale
    return [fft_growth(n) * total]


_fft.exact_terms = True


# --- variance ----------------------------------------------------------------------------------

def _dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return list(range(x.dim()))
    return [dim] if isinstance(dim, int) else list(dim)


def _variance(op, args, kwargs, outs):
    x = args[0]
    dims = _dims(x, _arg(args, kwargs, 1, "dim"))
    keepdim = bool(kwargs.get("keepdim", args[3] if len(args) > 3 else False))
    if op == "aten.var.dim":
        correction = 1 if _arg(args, kwargs, 2, "unbiased", True) else 0
    else:
        correction = kwargs.get("correction", args[2] if len(args) > 2 else None)
        correction = 1 if correction is None else float(correction)
    n = _prod(x.shape[d] for d in dims) if x.dim() else 1
    c = growth(n)
    squares = (x * x).sum(dim=dims, keepdim=keepdim) if x.dim() else x * x
    dvar = 3 * c * squares / max(n - correction, 1)
    if op.startswith("aten.std."):
        std = outs[0].abs()
        return [torch.minimum(dvar / (2 * std), dvar.sqrt()) + std]
    bounds = [dvar + outs[0].abs()]
    if op.startswith("aten.var_mean."):
        mean_abs = x.abs().mean(dim=dims, keepdim=keepdim) if x.dim() else x.abs()
        bounds.append(c * mean_abs)
    return bounds


# --- softmax -------------------------------------------------------------------------------------

def _softmax(op, args, kwargs, outs):
    x, dim = args[0], int(_arg(args, kwargs, 1, "dim", -1))
    c = growth(x.shape[dim] if x.dim() else 1)
    top = x.amax(dim=dim, keepdim=True) if x.dim() else x
    shifted = (x - top).abs()
    if "log_softmax" in op:
        log_sum = (x - top).exp().sum(dim=dim, keepdim=True).log() if x.dim() else torch.zeros_like(x)
        return [2 * shifted + top.abs() + outs[0].abs() + c + 4 * log_sum.abs() + 16]
    return [outs[0].abs() * (c + 4 + 3 * shifted)]


# --- normalization ------------------------------------------------------------------------------

def _normalized(x: torch.Tensor, rows: torch.Tensor, eps: float):
    """For ``x`` and its normalization groups as ``rows`` (a [groups, n] view of ``x``'s values):
    ``(x_hat error / u, mean error / u, rstd error / u, x_hat)``, each shaped as ``x`` (the mean
    and rstd errors per group [groups, 1]). To first order, with ``s = sqrt(var + eps)``:
    ``x - mean`` is off by ``u (|x| + |x - mean|) + dmean``, ``s`` relatively by ``dvar / (2 s**2)
    + 3 u`` (the square root's or inverse square root's ULPs), and ``x_hat`` by both over ``s``."""
    n = rows.shape[1]
    c = growth(n)
    mean = rows.mean(1, keepdim=True)
    var = rows.var(1, unbiased=False, keepdim=True)
    s = (var + eps).sqrt()
    dmean = c * rows.abs().mean(1, keepdim=True)
    ds = 1.5 * c * (rows * rows).mean(1, keepdim=True) / (s * s) + 3
    centred = rows - mean
    xhat = centred / s
    dxhat = (rows.abs() + centred.abs() + dmean) / s + xhat.abs() * (ds + 1)
    return dxhat.reshape(x.shape), dmean, ds / s, xhat.reshape(x.shape)


def _affine(dxhat, xhat, out, weight, bias, shape):
    """The error of ``y = x_hat w + b`` (in ``u``): ``|w| dx_hat`` plus the product's and sum's roundings."""
    w = torch.ones(()) if weight is None else weight.reshape(shape).abs()
    return w * dxhat + (xhat * w).abs() + out.abs() + (0 if bias is None else bias.reshape(shape).abs())


def _layer_norm(op, args, kwargs, outs):
    x, shape, weight, bias = args[0], list(args[1]), _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "bias")
    eps = float(_arg(args, kwargs, 4, "eps", 1e-5))
    k = _prod(shape)
    dxhat, dmean, drstd, xhat = _normalized(x, x.reshape(-1, k), eps)
    stats = [t.reshape(outs[i].shape) for i, t in ((1, dmean), (2, drstd))] if len(outs) == 3 else []
    return [_affine(dxhat, xhat, outs[0], weight, bias, shape)] + stats


def _group_norm(op, args, kwargs, outs):
    x, weight, bias = args[0], args[1], args[2]
    groups, eps = int(args[6]), float(args[7])
    dxhat, dmean, drstd, xhat = _normalized(x, x.reshape(x.shape[0] * groups, -1), eps)
    shape = [1, -1] + [1] * (x.dim() - 2)
    return [_affine(dxhat, xhat, outs[0], weight, bias, shape),
            dmean.reshape(outs[1].shape), drstd.reshape(outs[2].shape)]


#: Batch norms that compute their statistics: op -> (position of training (None: always), of eps).
_BATCH_NORMS = {"aten.native_batch_norm.default": (5, 7), "aten._native_batch_norm_legit_functional.default": (5, 7),
                "aten._native_batch_norm_legit.no_stats": (3, 5),
                "aten._batch_norm_with_update_functional.default": (None, 6)}


def _batch_norm(op, args, kwargs, outs):
    x, weight, bias = args[0], args[1], args[2]
    training_at, eps_at = _BATCH_NORMS[op]
    if training_at is not None and not bool(args[training_at]):
        return [None] * len(outs)  # running statistics: elementwise, nothing accumulates
    rows = x.transpose(0, 1).reshape(x.shape[1], -1)
    dxhat, dmean, drstd, xhat = _normalized(x.transpose(0, 1), rows, float(args[eps_at]))
    shape = [1, -1] + [1] * (x.dim() - 2)
    y = _affine(dxhat.transpose(0, 1), xhat.transpose(0, 1), outs[0], weight, bias, shape)
    return [y, dmean.reshape(outs[1].shape), drstd.reshape(outs[2].shape)] + [None] * (len(outs) - 3)


def _vector_norm(op, args, kwargs, outs):
    x = args[0]
    order = float(_arg(args, kwargs, 1, "ord", 2))
    if not math.isfinite(order) or order <= 0:
        return [None]  # max, min or a count: nothing accumulates
    n = _reduced(args, kwargs, outs[0])
    # the sum of |x|**p has no cancellation (relative c u), the p-th root divides it by p,
    # and the powers and the root round a few times more
    return [(growth(n) / order + 4) * outs[0].abs()]


#: Accumulating ops (aten overload name) -> their bound: ``bound(op, args, kwargs, outputs64)``
#: returns, per output, the allowed error against float64 in units of ``u`` (None: no bound).
ACCUMULATING: dict[str, Callable] = {
    **dict.fromkeys(("aten._fft_r2c.default", "aten._fft_c2r.default", "aten._fft_c2c.default"), _fft),
    **dict.fromkeys(("aten.mm.default", "aten.bmm.default", "aten.matmul.default", "aten.mv.default"), _terms(_inner)),
    "aten.dot.default": _terms(lambda a, k, o: int(a[0].numel())),
    "aten.addmm.default": _terms(_inner_plus_one(1)), "aten.addmv.default": _terms(_inner_plus_one(1)),
    "aten.baddbmm.default": _terms(_inner_plus_one(1)),
    "aten.addbmm.default": _terms(lambda a, k, o: int(a[1].shape[0] * a[1].shape[-1]) + 1),
    "aten.linear.default": _terms(_inner_plus_one(0)),
    "aten.convolution.default": _terms(_convolution),
    **dict.fromkeys(("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default"), _terms(_conv)),
    **dict.fromkeys(("aten.conv_transpose1d.default", "aten.conv_transpose2d.input", "aten.conv_transpose3d.input"),
                    _terms(_conv_transpose)),
    **dict.fromkeys(("aten.sum.default", "aten.sum.dim_IntList", "aten.mean.default", "aten.mean.dim"),
                    _terms(_reduced)),
    "aten.cumsum.default": _terms(_along_dim),
    **dict.fromkeys(("aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.avg_pool3d.default"),
                    _terms(_pool_window)),
    **dict.fromkeys(("aten._adaptive_avg_pool2d.default", "aten._adaptive_avg_pool3d.default",
                     "aten.adaptive_avg_pool1d.default"), _terms(_adaptive_window)),
    **dict.fromkeys(("aten.prod.default", "aten.prod.dim_int"), _products(_reduced)),
    "aten.cumprod.default": _products(_along_dim),
    **dict.fromkeys(("aten.var.correction", "aten.var.dim", "aten.std.correction", "aten.std.dim",
                     "aten.var_mean.correction"), _variance),
    **dict.fromkeys(("aten._softmax.default", "aten.softmax.int", "aten._log_softmax.default",
                     "aten.log_softmax.int"), _softmax),
    "aten.native_layer_norm.default": _layer_norm,
    "aten.native_group_norm.default": _group_norm,
    **dict.fromkeys(_BATCH_NORMS, _batch_norm),
    "aten.linalg_vector_norm.default": _vector_norm,
}


#: Sums of products: their magnitude of terms is exact, so their bound is the rule that decides
#: (no tolerance fast path: rtol 1e-3 would pass a kernel that scales its outputs by 1.001).
DECIDED_BY_BOUND = frozenset(op for op, bound in ACCUMULATING.items() if getattr(bound, "exact_terms", False))


def accumulates(op: str) -> bool:
    """Whether ``op`` (an aten overload name) has an arithmetic bound (:data:`ACCUMULATING`)."""
    return op in ACCUMULATING


def arithmetic_bounds(op: str, args: list, kwargs: dict, outputs: list[torch.Tensor],
                      dtype: str) -> list[torch.Tensor | None] | None:
    """Per output of ``op``, the error against its float64 result ``outputs`` a correct target
    computing in ``dtype`` may have (a tensor of the output's shape), or None for an output
    with no bound; None when ``op`` does not accumulate. ``args``/``kwargs`` are the op's
    decoded arguments with every floating tensor in float64."""
    bound = ACCUMULATING.get(op)
    if bound is None or dtype not in UNIT_ROUNDOFF:
        return None
    u = UNIT_ROUNDOFF[dtype]
    with torch.no_grad():
        per_output = bound(op, args, kwargs, [o.double() if o.is_floating_point() else o for o in outputs])
    return [None if b is None else (u * b.double()).expand(o.shape) if b.dim() <= o.dim() else None
            for b, o in zip(per_output, outputs)]
