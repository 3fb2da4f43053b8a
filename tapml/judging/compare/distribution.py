"""Random ops judged by distribution: shapes and dtypes as the reference's, then the law
of the values (sample moments, Kolmogorov-Smirnov, chi-square), never the values themselves."""

from __future__ import annotations

import math

import torch

from tapml.judging.compare.values import Comparison, compare_tensor, metadata_mismatch
from tapml.graph import dtype_name


# --- random ops: judged by distribution ----------------------------------------------------

#: Op packets whose outputs are random draws (any overload): their values cannot be compared
#: with the reference's, nor can anything computed from them.
RANDOM_PACKETS = frozenset({"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
                            "bernoulli", "native_dropout", "dropout", "normal", "normal_functional", "uniform", "exponential",
                            "multinomial", "poisson", "cauchy", "log_normal", "geometric", "random",
                            "rrelu_with_noise", "rrelu_with_noise_functional"})
#: Random ops whose distribution :func:`compare_distribution` knows.
RANDOM_OPS = frozenset({"aten.rand.default", "aten.rand_like.default", "aten.randn.default", "aten.randn_like.default",
                        "aten.bernoulli.p", "aten.bernoulli.default", "aten.native_dropout.default",
                        "aten.randint.default", "aten.randint.low", "aten.randint_like.default",
                        "aten.randint_like.low_dtype", "aten.randperm.default", "aten.bernoulli.Tensor",
                        "aten.normal.Tensor_float", "aten.normal.float_Tensor", "aten.normal.Tensor_Tensor",
                        "aten.normal.float_float", "aten.normal_functional.default", "aten.uniform.default",
                        "aten.exponential.default", "aten.multinomial.default", "aten.cauchy.default",
                        "aten.log_normal.default", "aten.geometric.default",
                        "aten.rrelu_with_noise_functional.default"})
#: Where each normal overload holds its mean and std: ``((index, keyword, default), ...)``.
NORMAL_ARGUMENTS = {"aten.normal.Tensor_float": ((0, "mean", None), (1, "std", 1.0)),
                    "aten.normal.float_Tensor": ((0, "mean", None), (1, "std", None)),
                    "aten.normal.Tensor_Tensor": ((0, "mean", None), (1, "std", None)),
                    "aten.normal.float_float": ((0, "mean", None), (1, "std", None)),
                    "aten.normal_functional.default": ((1, "mean", 0.0), (2, "std", 1.0))}
#: What a random op's verdict says first.
RANDOM_NOTE = "random op: compared on shape, dtype and distribution, not values"
#: Standard deviations a sample statistic may stray from its expectation, and the
#: Kolmogorov-Smirnov constant (bound ``KS_CONSTANT / sqrt(n)``; 2.5 is a 2.5e-5 false alarm).
SIGMAS = 6.0
KS_CONSTANT = 2.5
#: Half a grid step of the low floats near 1, added to KS bounds (values are rounded to the dtype).
_RESOLUTION = {"float32": 0.0, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
#: Significand bits of the floats: every integer up to 2**bits is exact in them.
_SIGNIFICAND = {"float32": 24, "float16": 11, "bfloat16": 8, "float64": 53}


def is_random_op(op: str) -> bool:
    """Whether ``op`` (an aten overload name) draws random values (:data:`RANDOM_PACKETS`)."""
    parts = op.split(".") if isinstance(op, str) else []
    return len(parts) == 3 and parts[0] == "aten" and parts[1] in RANDOM_PACKETS



class _Draws:
    """The checks of one random output: each adds a stat to the message; the first failed one
    is the reason."""

    def __init__(self):
        self.stats: list[str] = []
        self.failed: str = ""

    def check(self, ok: bool, stat: str, why: str = "") -> bool:
        self.stats.append(stat)
        if not ok and not self.failed:
            self.failed = why or stat
        return ok

    def near(self, name: str, value: float, expected: float, tol: float) -> bool:
        ok = math.isfinite(value) and abs(value - expected) <= tol
        return self.check(ok, f"{name} {value:.4g} (expected {expected:.4g} ± {tol:.2g})",
                          f"{name} {value:.4g} is not within {tol:.2g} of {expected:.4g}")

    def ks(self, name: str, sample: torch.Tensor, cdf, resolution: float = 0.0, below=None) -> bool:
        """Kolmogorov-Smirnov distance of ``sample`` to ``cdf``; for a discrete law, ``below(x)``
        is its probability below ``x`` (``cdf`` just left of ``x``), where the sample's own
        distribution function jumps."""
        n = sample.numel()
        x = sample.double().sort().values
        f = cdf(x)
        i = torch.arange(1, n + 1, dtype=torch.float64)
        d = float(torch.maximum(i / n - f, (f if below is None else below(x)) - (i - 1) / n).max())
        bound = KS_CONSTANT / math.sqrt(n) + resolution
        return self.check(d <= bound, f"KS distance to {name} {d:.4f} ≤ {bound:.4f}",
                          f"Kolmogorov-Smirnov distance to {name} {d:.4f} > {bound:.4f}")

    def result(self, n: int, elementwise_bad: float | None = None) -> Comparison:
        stats = ", ".join([f"n={n}"] + self.stats)
        if self.failed:
            return Comparison(False, mismatch_fraction=elementwise_bad,
                              message=f"{RANDOM_NOTE}: {self.failed} ({stats})")
        return Comparison(True, mismatch_fraction=0.0, message=f"{RANDOM_NOTE} ({stats})")


def _uniform01(t: torch.Tensor, d: _Draws) -> None:
    x = t.reshape(-1).double()
    n = x.numel()
    if not d.check(bool(((x >= 0) & (x < 1)).all()), "all in [0, 1)",
                   f"{int((~((x >= 0) & (x < 1))).sum())} values outside [0, 1)"):
        return
    res = _RESOLUTION[dtype_name(t.dtype)]
    d.near("mean", float(x.mean()), 0.5, SIGMAS * math.sqrt(1 / 12 / n) + res)
    if n > 1:  # the sample variance's standard error: sqrt((1/80 - 1/144) / n)
        d.near("variance", float(x.var()), 1 / 12, SIGMAS * 0.0745 / math.sqrt(n) + 2 * res)
    d.ks("uniform [0, 1)", x, lambda v: v, res)


def _standard_normal(t: torch.Tensor, d: _Draws) -> None:
    x = t.reshape(-1).double()
    n = x.numel()
    if not d.check(bool(torch.isfinite(x).all()), "all finite", f"{int((~torch.isfinite(x)).sum())} values not finite"):
        return
    res = _RESOLUTION[dtype_name(t.dtype)]
    d.near("mean", float(x.mean()), 0.0, SIGMAS / math.sqrt(n) + res)
    if n > 1:
        d.near("variance", float(x.var()), 1.0, SIGMAS * math.sqrt(2 / n) + 4 * res)
    d.ks("the standard normal", x, torch.special.ndtr, res)


def _bernoulli(t: torch.Tensor, p: torch.Tensor, d: _Draws) -> float | None:
    """Checks draws ``t`` of Bernoulli(``p``) (``p`` broadcast to ``t``); returns the fraction of
    elements that break a certainty (p = 0 drawn 1, p = 1 drawn 0, a value not 0 or 1)."""
    x = t.reshape(-1).double()
    n = x.numel()
    try:
        p = torch.broadcast_to(p.double(), tuple(t.shape)).reshape(-1)
    except RuntimeError:
        d.check(False, "p's shape", f"p of shape {list(p.shape)} does not give the output's {list(t.shape)}")
        return None
    binary = (x == 0) | (x == 1)
    if not d.check(bool(binary.all()), "all 0 or 1", f"{int((~binary).sum())} values are neither 0 nor 1"):
        return float((~binary).sum()) / n
    certain_bad = ((p <= 0) & (x != 0)) | ((p >= 1) & (x != 1))
    if not d.check(not bool(certain_bad.any()), "p=0 gives 0 and p=1 gives 1",
                   f"{int(certain_bad.sum())} elements with p of 0 or 1 drew the other value"):
        return float(certain_bad.sum()) / n
    pc = p.clamp(0, 1)
    d.near("ones", float(x.sum()), float(pc.sum()), SIGMAS * math.sqrt(float((pc * (1 - pc)).sum())) + 1)
    return None


def _uniform_ints(t: torch.Tensor, low: int, high: int, d: _Draws) -> None:
    x = t.reshape(-1).double()
    n, m = x.numel(), high - low
    lo_b, hi_b = float(low), float(high - 1)
    if t.dtype.is_floating_point:  # the bounds as the dtype holds them
        lo_b, hi_b = float(torch.tensor(float(low)).to(t.dtype)), float(torch.tensor(float(high - 1)).to(t.dtype))
    inside = (x >= lo_b) & (x <= hi_b) & (x == x.round())
    if not d.check(bool(inside.all()), f"all integers in [{low}, {high})",
                   f"{int((~inside).sum())} values are not integers in [{low}, {high})"):
        return
    ulp = 0.0 if not t.dtype.is_floating_point else float(torch.finfo(t.dtype).eps) * max(abs(low), abs(high))
    sd = math.sqrt((m * m - 1) / 12)
    d.near("mean", float(x.mean()), low + (m - 1) / 2, SIGMAS * sd / math.sqrt(n) + ulp)
    exact = not t.dtype.is_floating_point or max(abs(low), abs(high)) <= 2 ** _SIGNIFICAND[dtype_name(t.dtype)]
    if m <= 4096 and n >= 5 * m and exact:
        counts = torch.bincount((x - low).long(), minlength=m).double()
        e = n / m
        tol = SIGMAS * math.sqrt(e * (1 - 1 / m)) + 1
        worst = float((counts - e).abs().max())
        d.check(worst <= tol, f"every value drawn {e:.1f} ± {tol:.1f} times",
                f"a value is drawn {worst:.0f} times off the expected {e:.1f} (allowed {tol:.1f})")
    else:
        d.ks(f"uniform on [{low}, {high})", (x - low + 0.5) / m, lambda v: v, 1 / m + ulp / m)


def compare_distribution(op: str, targets: list[torch.Tensor], refs: list[torch.Tensor], args: list,
                         kwargs: dict | None = None) -> Comparison:
    """Judge a random op's outputs ``targets`` by what ``op`` promises, not by value: shapes and
    dtypes as the reference's ``refs``, then the distribution of the values given the op's
    decoded ``args``/``kwargs`` (tensors as tensors). Thresholds are deterministic: a sample
    mean within :data:`SIGMAS` standard errors, a Kolmogorov-Smirnov distance within
    ``KS_CONSTANT / sqrt(n)`` (plus the grid step of float16/bfloat16), so a small sample is
    judged leniently and a large one closely.

    - ``rand``/``rand_like``: uniform in [0, 1) (mean, variance, KS);
    - ``randn``/``randn_like``: standard normal (mean, variance, KS);
    - ``bernoulli``: 0 or 1, certain where p is 0 or 1, the count of ones near ``sum(p)``;
    - ``native_dropout``: training: the output is ``x * mask / (1 - p)`` elementwise with the
      target's own mask, and the dropped fraction near p; evaluation: ``x`` and an all-True mask;
    - ``randint``: integers in [low, high), uniform (counts per value, or KS for wide ranges);
    - ``randperm``: a permutation of ``range(n)``, not close to the identity or its reverse;
    - ``normal`` (every overload): where mean and std are finite and std > 0, ``(x - mean) / std``
      is standard normal (mean, variance, KS; elements the dtype's rounding cannot resolve are
      left out); std 0 gives the mean, an infinite mean or std a value that is not finite (NaN
      where either is NaN);
    - ``uniform``: in [from, to) (``to`` only as often as rounding to the dtype makes it), with
      the uniform's mean, variance and KS distance;
    - ``exponential``: positive and finite (a zero only as often as the dtype rounds one), mean
      ``1/lambd``, variance ``1/lambd**2``, KS distance to the exponential;
    - ``multinomial``: indices in range, never a category of weight 0, distinct per row without
      replacement, and every category's count near what the (conditional) probabilities expect,
      with a chi-square bound over all of them;
    - ``cauchy``: no NaN, half the values below the median and half within ``median ± sigma``
      (its quartiles; the mean does not exist), KS distance to the Cauchy law;
    - ``log_normal``: ≥ 0, ``(log(x) - mean) / std`` standard normal (mean, variance, KS);
    - ``geometric``: integers ≥ 1, mean ``1/p``, KS distance to ``1 - (1-p)**k`` and a
      chi-square over the counts of each value;
    - ``rrelu_with_noise_functional``: training: where ``x > 0`` (or NaN) the output is ``x``
      and the noise 1, where ``x <= 0`` the noise is uniform in [lower, upper] (KS) and the
      output ``x * noise``; evaluation: ``leaky_relu(x, (lower + upper) / 2)`` and the noise
      input, compared by value.

    The message starts with :data:`RANDOM_NOTE` and gives the statistics. Example::

        compare_distribution("aten.rand.default", [t], [torch.rand(4096)], [[4096]]).passed
    """
    kwargs = kwargs or {}
    if why := metadata_mismatch(targets, refs):
        return Comparison(False, message=f"{RANDOM_NOTE}: {why}")
    if op not in RANDOM_OPS:
        return Comparison(False, message=f"{RANDOM_NOTE}: no distribution is known for {op}")
    out = targets[0].detach().cpu()
    n = out.numel()
    d = _Draws()
    if n == 0:
        return d.result(0)
    try:
        params = _random_params(op, list(args), kwargs)
    except (TypeError, ValueError, IndexError, KeyError) as e:  # arguments from a file
        return Comparison(False, message=f"{RANDOM_NOTE}: cannot read the arguments of {op}: {e}")
    packet = op.split(".")[1]
    if packet in ("rand", "rand_like"):
        _uniform01(out, d)
    elif packet in ("randn", "randn_like"):
        _standard_normal(out, d)
    elif packet == "bernoulli":
        return d.result(n, _bernoulli(out, params["p"], d))
    elif packet == "native_dropout":
        return _dropout(targets, params["x"], params["p"], params["train"], d)
    elif packet == "randperm":
        _permutation(out, d)
    elif packet in ("normal", "normal_functional"):
        return d.result(n, _normal(out, params["mean"], params["std"], d))
    elif packet == "uniform":
        _uniform_range(out, params["from"], params["to"], d)
    elif packet == "exponential":
        _exponential(out, params["lambd"], d)
    elif packet == "multinomial":
        return d.result(n, _categorical(out, params["p"], params["replacement"], d))
    elif packet == "cauchy":
        _cauchy(out, params["median"], params["sigma"], d)
    elif packet == "log_normal":
        _log_normal(out, params["mean"], params["std"], d)
    elif packet == "geometric":
        _geometric(out, params["p"], d)
    elif packet == "rrelu_with_noise_functional":
        return _rrelu(targets, refs, params, d)
    else:
        _uniform_ints(out, params["low"], params["high"], d)
    return d.result(n)


def _random_params(op: str, a: list, kwargs: dict) -> dict:
    """The parameters of a random op's distribution from its decoded arguments (ValueError,
    TypeError or IndexError when they are not what the op takes)."""
    def prob(v) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"p={v!r} is not a probability in [0, 1]")
        return float(v)

    def integer(v) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{v!r} is not an integer")
        return v

    def tensor(v) -> torch.Tensor:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{type(v).__name__} is not a tensor")
        return v.detach().cpu()

    def real(v) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{v!r} is not a number")
        return float(v)

    def arg(i: int, name: str, default=None):
        if len(a) > i:
            return a[i]
        if default is None:
            return kwargs[name]
        return kwargs.get(name, default)

    if op in NORMAL_ARGUMENTS:
        (mi, mname, mdef), (si, sname, sdef) = NORMAL_ARGUMENTS[op]
        mean, std = arg(mi, mname, mdef), arg(si, sname, sdef)
        mean = tensor(mean) if isinstance(mean, torch.Tensor) else real(mean)
        std = tensor(std) if isinstance(std, torch.Tensor) else real(std)
        if not isinstance(std, torch.Tensor) and not std >= 0:
            raise ValueError(f"std={std!r} is not a standard deviation (>= 0)")
        return {"mean": mean, "std": std}
    if op == "aten.uniform.default":
        low, high = real(arg(1, "from", 0.0)), real(arg(2, "to", 1.0))
        if not (math.isfinite(low) and math.isfinite(high) and low <= high):
            raise ValueError(f"[{low!r}, {high!r}) is not a range of finite numbers")
        return {"from": low, "to": high}
    if op == "aten.exponential.default":
        lambd = real(arg(1, "lambd", 1.0))
        if not (math.isfinite(lambd) and lambd > 0):
            raise ValueError(f"lambd={lambd!r} is not a finite rate > 0")
        return {"lambd": lambd}
    if op == "aten.multinomial.default":
        replacement = arg(2, "replacement", False)
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement={replacement!r} is not a bool")
        return {"p": tensor(a[0]), "num_samples": integer(arg(1, "num_samples")), "replacement": replacement}
    if op in ("aten.cauchy.default", "aten.log_normal.default"):
        (where, wdef), (scale, sdef) = (("median", 0.0), ("sigma", 1.0)) if "cauchy" in op else (("mean", 1.0),
                                                                                                ("std", 2.0))
        loc, spread = real(arg(1, where, wdef)), real(arg(2, scale, sdef))
        if not (math.isfinite(loc) and math.isfinite(spread) and spread > 0):
            raise ValueError(f"{where}={loc!r}, {scale}={spread!r}: not finite with {scale} > 0")
        return {where: loc, scale: spread}
    if op == "aten.geometric.default":
        p = real(arg(1, "p"))
        if not 0 < p < 1:
            raise ValueError(f"p={p!r} is not a probability in (0, 1)")
        return {"p": p}
    if op == "aten.rrelu_with_noise_functional.default":
        lower, upper = real(arg(2, "lower", 0.125)), real(arg(3, "upper", 1 / 3))
        training = arg(4, "training", False)
        if not (math.isfinite(lower) and math.isfinite(upper) and lower <= upper):
            raise ValueError(f"[{lower!r}, {upper!r}] is not a range of finite numbers")
        if not isinstance(training, bool):
            raise TypeError(f"training={training!r} is not a bool")
        return {"x": tensor(a[0]), "noise": tensor(arg(1, "noise")), "lower": lower, "upper": upper,
                "training": training}
    if op == "aten.bernoulli.Tensor":
        return {"p": tensor(arg(1, "p"))}
    if op == "aten.bernoulli.p":
        return {"p": torch.tensor(prob(a[1] if len(a) > 1 else kwargs.get("p", 0.5)))}
    if op == "aten.bernoulli.default":
        return {"p": tensor(a[0])}
    if op == "aten.native_dropout.default":
        train = a[2] if len(a) > 2 else kwargs.get("train")
        if train not in (True, False, None):
            raise TypeError(f"train={train!r} is not a bool")
        return {"x": tensor(a[0]), "p": prob(a[1] if len(a) > 1 else kwargs["p"]), "train": train}
    bounds = {"aten.randint.default": lambda: (0, a[0]), "aten.randint.low": lambda: (a[0], a[1]),
              "aten.randint_like.default": lambda: (0, a[1]), "aten.randint_like.low_dtype": lambda: (a[1], a[2])}
    if op in bounds:
        low, high = (integer(v) for v in bounds[op]())
        if not low < high:
            raise ValueError(f"[{low}, {high}) is an empty range")
        return {"low": low, "high": high}
    return {}


def _rounding(dtype: torch.dtype) -> float:
    """A bound on the relative error of rounding a value to ``dtype`` (one unit in the last place)."""
    return 2.0 ** (1 - _SIGNIFICAND[dtype_name(dtype)])


def _normal(t: torch.Tensor, mean, std, d: _Draws) -> float | None:
    """Checks draws ``t`` of N(``mean``, ``std``) (numbers or tensors broadcast to ``t``); returns
    the fraction of elements their parameters fix and that break it (None when none do)."""
    try:
        m = torch.broadcast_to(torch.as_tensor(mean, dtype=torch.float64), tuple(t.shape)).reshape(-1)
        s = torch.broadcast_to(torch.as_tensor(std, dtype=torch.float64), tuple(t.shape)).reshape(-1)
    except RuntimeError:
        d.check(False, "mean and std shapes", f"mean and std do not broadcast to the output's {list(t.shape)}")
        return None
    x = t.reshape(-1).double()
    n = x.numel()
    if not d.check(not bool((s < 0).any() or s.isnan().any()), "std ≥ 0", "std has negative or NaN elements"):
        return None
    given = torch.isfinite(m) & torch.isfinite(s)
    fixed = torch.zeros(n, dtype=torch.bool)
    rounded_mean = m.to(t.dtype).double()
    fixed |= ~given & torch.isfinite(x)  # an infinite mean or std draws no finite value
    fixed |= (m.isnan() | s.isnan()) & ~x.isnan()
    fixed |= given & (s == 0) & (x != rounded_mean)  # std 0: the mean itself
    regular = given & (s > 0)
    could_overflow = m.abs() + 10 * s > float(torch.finfo(t.dtype).max)
    fixed |= regular & ~torch.isfinite(x) & ~could_overflow
    if not d.check(not bool(fixed.any()), "std 0 and mean or std not finite as torch draws them",
                   f"{int(fixed.sum())} elements are not what their mean and std fix (std 0: the mean; a mean or "
                   "std that is not finite: a value that is not finite, NaN for NaN)"):
        return float(fixed.sum()) / n
    regular &= torch.isfinite(x)
    z = (x[regular] - m[regular]) / s[regular]
    # the dtype's rounding of x moves z by up to rel * max(|x|, |mean|) / std; an element is
    # left out when its parameters alone (not its draw: no selection bias) make that coarse
    rel = _rounding(t.dtype)
    r = rel * torch.maximum(x[regular].abs(), m[regular].abs()) / s[regular]
    resolved = rel * (m[regular].abs() / s[regular] + 1) <= 0.05
    z, r = z[resolved], r[resolved]
    k = z.numel()
    d.check(True, f"{k} standardized")
    if k == 0:
        return None
    d.near("mean of (x - mean) / std", float(z.mean()), 0.0, SIGMAS / math.sqrt(k) + float(r.mean()))
    if k > 1:
        d.near("variance of (x - mean) / std", float(z.var()), 1.0,
               SIGMAS * math.sqrt(2 / k) + 2 * float((z.abs() * r).mean()) + float((r * r).mean()))
    d.ks("the standard normal", z, torch.special.ndtr, 0.4 * float(r.max()))
    return None


def _uniform_range(t: torch.Tensor, low: float, high: float, d: _Draws) -> None:
    x = t.reshape(-1).double()
    n = x.numel()
    if low == high:
        at = float(torch.tensor(low, dtype=torch.float64).to(t.dtype))
        d.check(bool((x == at).all()), f"all {at:g} (from = to)", f"{int((x != at).sum())} values are not from = to")
        return
    rel, span = _rounding(t.dtype), high - low
    lo_b, hi_b = low - rel * abs(low), high + rel * abs(high)
    inside = (x >= lo_b) & (x <= hi_b)
    if not d.check(bool(inside.all()), f"all in [{low:g}, {high:g})",
                   f"{int((~inside).sum())} values outside [{low:g}, {high:g})"):
        return
    at_high = float((x >= high).sum())
    p_high = min(1.0, rel * abs(high) / span)  # the rounding of values just below `to` reaches it
    limit = n * p_high + SIGMAS * math.sqrt(n * p_high) + 1
    d.check(at_high <= limit, f"{at_high:.0f} at {high:g} ≤ {limit:.1f} (rounding)",
            f"{at_high:.0f} values are {high:g} or more, rounding makes at most {limit:.1f}")
    u = (x - low) / span
    res = rel * max(abs(low), abs(high)) / span
    d.near("mean of (x - from) / (to - from)", float(u.mean()), 0.5, SIGMAS * math.sqrt(1 / 12 / n) + res)
    if n > 1:
        d.near("its variance", float(u.var()), 1 / 12, SIGMAS * 0.0745 / math.sqrt(n) + 2 * res)
    d.ks(f"uniform [{low:g}, {high:g})", u, lambda v: v, res)


def _exponential(t: torch.Tensor, lambd: float, d: _Draws) -> None:
    x = t.reshape(-1).double()
    n = x.numel()
    ok = torch.isfinite(x) & (x >= 0)
    if not d.check(bool(ok.all()), "all finite and ≥ 0", f"{int((~ok).sum())} values are negative or not finite"):
        return
    # torch draws u = 0 with probability 2**-24; the dtype rounds values below its smallest normal
    p_zero = 2.0 ** -24 + min(1.0, lambd * float(torch.finfo(t.dtype).tiny))
    zeros = float((x == 0).sum())
    limit = n * p_zero + SIGMAS * math.sqrt(n * p_zero) + 1
    d.check(zeros <= limit, f"{zeros:.0f} zeros ≤ {limit:.1f}",
            f"{zeros:.0f} values are 0, an exponential draw rounds to 0 at most {limit:.1f} times here")
    v = x * lambd
    res = _rounding(t.dtype)
    d.near("mean of lambd * x", float(v.mean()), 1.0, SIGMAS / math.sqrt(n) + res)
    if n > 1:  # the sample variance of Exp(1) has standard error sqrt(8 / n)
        d.near("variance of lambd * x", float(v.var()), 1.0, SIGMAS * math.sqrt(8 / n) + 4 * res)
    d.ks("the exponential", v, lambda w: -torch.expm1(-w), res)


#: At most this many probabilities (rows x categories x draws) go into a multinomial check.
_CATEGORICAL_WORK = 2 * 10 ** 7


def _categorical(t: torch.Tensor, p: torch.Tensor, replacement: bool, d: _Draws) -> float | None:
    """Checks indices ``t`` drawn by multinomial from weights ``p``; returns the fraction of
    draws that are impossible (out of range, of weight 0, a repeat without replacement)."""
    if p.dim() not in (1, 2) or t.dim() != p.dim() or tuple(t.shape[:-1]) != tuple(p.shape[:-1]):
        d.check(False, "shapes", f"indices {list(t.shape)} are not multinomial's draws from weights {list(p.shape)}")
        return None
    cats = p.shape[-1]
    w = p.double().reshape(-1, cats)
    rows, draws = w.shape[0], t.shape[-1]
    x = t.reshape(rows, draws).long()
    total = w.sum(1)
    if not d.check(bool(torch.isfinite(w).all() and (w >= 0).all() and (total > 0).all()), "weights a distribution",
                   "the weights are not a distribution (finite, ≥ 0, a positive sum per row)"):
        return None
    inside = (x >= 0) & (x < cats)
    if not d.check(bool(inside.all()), f"all in [0, {cats})", f"{int((~inside).sum())} indices outside [0, {cats})"):
        return float((~inside).sum()) / x.numel()
    weightless = w.gather(1, x) <= 0
    if not d.check(not bool(weightless.any()), "never a category of weight 0",
                   f"{int(weightless.sum())} draws picked a category of weight 0"):
        return float(weightless.sum()) / x.numel()
    if not replacement and draws > 1:
        ordered = x.sort(1).values
        repeats = int((ordered[:, 1:] == ordered[:, :-1]).sum())
        if not d.check(repeats == 0, "distinct per row", f"{repeats} repeated indices without replacement"):
            return repeats / x.numel()
    observed, expected, variance = (torch.zeros(cats, dtype=torch.float64) for _ in range(3))
    # the probability of the category each draw picks: its mean is sum(q**2) per row, which
    # sees a draw that ignores its own row's weights even where rows average out over categories
    picked = [0.0, 0.0, 0.0]  # sum, expected sum, variance

    def weigh(q: torch.Tensor, drawn: torch.Tensor, times: int) -> None:
        q2 = (q * q).sum(1)
        picked[0] += float(q.gather(1, drawn).sum())
        picked[1] += times * float(q2.sum())
        picked[2] += times * float(((q * q * q).sum(1) - q2 * q2).clamp_min(0).sum())

    if replacement:  # every draw of a row is Categorical(w / total)
        q = w / total[:, None]
        expected, variance = draws * q.sum(0), draws * (q * (1 - q)).sum(0)
        observed = torch.bincount(x.reshape(-1), minlength=cats).double()
        weigh(q, x, draws)
        checked = draws
    else:  # draw c is Categorical of the weights not drawn before it in its row
        checked = max(1, min(draws, _CATEGORICAL_WORK // max(1, rows * cats)))
        left = w.clone()
        for c in range(checked):
            q = left / left.sum(1, keepdim=True).clamp_min(1e-300)
            expected += q.sum(0)
            variance += (q * (1 - q)).sum(0)
            observed += torch.bincount(x[:, c], minlength=cats).double()
            weigh(q, x[:, c:c + 1], 1)
            left[torch.arange(rows), x[:, c]] = 0.0
    # Bernstein's (Freedman's) bound for sums of terms within [0, 1]: off by at most
    # t/3 + sqrt(t**2/9 + 2 t var) with t = SIGMAS**2 / 2, a normal SIGMAS-sigma tail, which
    # stays sound where the counts are small and skewed (a category expected 0.01 times)
    t = SIGMAS ** 2 / 2
    count = rows * checked
    d.near("mean probability of the drawn category", picked[0] / count, picked[1] / count,
           (t / 3 + math.sqrt(t * t / 9 + 2 * t * picked[2]) + 1e-6 * count) / count)
    tol = t / 3 + (t * t / 9 + 2 * t * variance).sqrt()
    off = (observed - expected).abs() - tol
    worst = int(off.argmax())
    d.check(float(off[worst]) <= 0, "every category's count within a Bernstein bound",
            f"category {worst} is drawn {observed[worst]:.0f} times, expected {expected[worst]:.1f} ± "
            f"{tol[worst]:.1f}")
    # chi-square over categories expected 5 times or more (the rest pooled), against the
    # Laurent-Massart bound df + 2 sqrt(df t) + 2t with t = 18 (a 1.5e-8 false alarm)
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    o = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    keep = e >= 5
    df = int(keep.sum()) - 1
    if df >= 1:
        chi2 = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
        bound = df + 2 * math.sqrt(18 * df) + 36
        d.check(chi2 <= bound, f"chi-square {chi2:.1f} ≤ {bound:.1f} ({df} df, {checked} of {draws} draws a row)",
                f"chi-square {chi2:.1f} > {bound:.1f} over {df + 1} categories: frequencies do not follow the weights")
    return None


def _dropout(targets: list[torch.Tensor], x: torch.Tensor, p: float, train, d: _Draws) -> Comparison:
    out, mask = (t.detach().cpu() for t in targets)
    n = out.numel()
    if mask.dtype != torch.bool or x.shape != out.shape:
        d.check(False, "mask and input",
                f"the mask is {dtype_name(mask.dtype)}, the input {list(x.shape)}: not native_dropout's")
        return d.result(n)
    if train is False:
        same = compare_tensor(out, x)
        d.check(same.passed, "evaluation: the output is the input", f"evaluation: the output is not the input "
                f"({same.message})")
        d.check(bool(mask.all()), "the mask is all True", f"evaluation: {int((~mask).sum())} mask elements are False")
        return d.result(n, None if same.passed else same.mismatch_fraction)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    expected = x.mul(mask).mul_(scale)  # torch's own formula, with the target's mask
    same = compare_tensor(out, expected)
    if not d.check(same.passed, "output = input * mask / (1 - p)",
                   f"the output is not input * mask / (1 - p) with its own mask ({same.message})"):
        return d.result(n, same.mismatch_fraction)
    dropped = float((~mask).sum())
    d.near("dropped", dropped, n * p, SIGMAS * math.sqrt(n * p * (1 - p)) + 1)
    return d.result(n)


def _cauchy(t: torch.Tensor, median: float, sigma: float, d: _Draws) -> None:
    x = t.reshape(-1).double()
    n = x.numel()
    if not d.check(not bool(x.isnan().any()), "no NaN", f"{int(x.isnan().sum())} values are NaN"):
        return
    v = (x - median) / sigma
    # rounding x to the dtype moves the law's distribution function by at most its density
    # (1/pi at most) times the move: rel * (|v| + |median| / sigma), and |v| / (pi (1 + v**2)) <= 1/(2 pi)
    rel = _rounding(t.dtype) if t.dtype != torch.float32 else 0.0
    res = rel * (0.5 + abs(median) / sigma) / math.pi
    spread = SIGMAS * math.sqrt(n / 4) + n * res + 1
    d.near("values below the median", float((v < 0).sum()), n / 2, spread)
    d.near("values within median ± sigma", float((v.abs() <= 1).sum()), n / 2, spread)
    d.ks("the Cauchy law", v, lambda w: 0.5 + torch.atan(w) / math.pi, res)


def _log_normal(t: torch.Tensor, mean: float, std: float, d: _Draws) -> None:
    x = t.reshape(-1).double()
    n = x.numel()
    if not d.check(bool((x >= 0).all()), "all ≥ 0", f"{int((~(x >= 0)).sum())} values are negative or NaN"):
        return
    z = (x.log() - mean) / std  # 0 and Inf (the dtype's underflow and overflow) give -Inf and Inf
    rel = _rounding(t.dtype) if t.dtype != torch.float32 else 0.0
    res = rel / std
    finite = torch.isfinite(z)
    if bool(finite.all()):
        d.near("mean of (log(x) - mean) / std", float(z.mean()), 0.0, SIGMAS / math.sqrt(n) + res)
        if n > 1:
            d.near("variance of (log(x) - mean) / std", float(z.var()), 1.0, SIGMAS * math.sqrt(2 / n) + 4 * res)
    d.ks("the standard normal, of (log(x) - mean) / std", z, torch.special.ndtr, 0.4 * res)


def _geometric(t: torch.Tensor, p: float, d: _Draws) -> None:
    x = t.reshape(-1).double()
    n = x.numel()
    ok = (x >= 1) & (x == x.floor())
    if not d.check(bool(ok.all()), "all integers ≥ 1", f"{int((~ok).sum())} values are not integers ≥ 1"):
        return
    q = math.log1p(-p)
    # a float dtype rounds integers past 2**significand: only values that far off may move
    exact = 2 ** _SIGNIFICAND[dtype_name(t.dtype)] if t.dtype.is_floating_point else math.inf
    res = min(1.0, math.exp(q * exact)) if math.isfinite(exact) else 0.0
    if bool(torch.isfinite(x).all()):
        sd = math.sqrt(1 - p) / p
        d.near("mean", float(x.mean()), 1 / p, SIGMAS * sd / math.sqrt(n) + (res * float(x.max()) if res else 0.0))
    d.ks("the geometric law", x, lambda k: -torch.expm1(k * q), res, below=lambda k: -torch.expm1((k - 1) * q))
    # chi-square over the values expected 5 times or more (the tail pooled), bound as multinomial's
    top = int(math.log(5 / (n * p)) / q) + 1 if n * p > 5 else 0
    if top >= 2 and res <= 1e-9:
        values = torch.arange(1, top + 1, dtype=torch.float64)
        expected = torch.cat([n * p * torch.exp((values - 1) * q), torch.tensor([n * math.exp(top * q)])])
        observed = torch.cat([torch.bincount(x.clamp(max=top + 1).long(), minlength=top + 2)[1:top + 1].double(),
                              (x > top).sum().reshape(1).double()])
        keep = expected >= 5
        df = int(keep.sum()) - 1
        chi2 = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        bound = df + 2 * math.sqrt(18 * df) + 36
        d.check(chi2 <= bound, f"chi-square {chi2:.1f} ≤ {bound:.1f} ({df} df)",
                f"chi-square {chi2:.1f} > {bound:.1f} over {df + 1} values: counts do not follow (1-p)**(k-1) p")


def _rrelu(targets: list[torch.Tensor], refs: list[torch.Tensor], params: dict, d: _Draws) -> Comparison:
    out, noise = (t.detach().cpu() for t in targets)
    x = params["x"]
    n = out.numel()
    if x.shape != out.shape or params["noise"].shape != noise.shape:
        d.check(False, "shapes", f"the input {list(x.shape)} and noise {list(params['noise'].shape)} are not "
                f"the outputs' {list(out.shape)}")
        return d.result(n)
    if not params["training"]:  # no draw: compared by value
        same = [compare_tensor(t, r.detach().cpu()) for t, r in zip(targets, refs)]
        d.check(same[0].passed, "evaluation: the output is leaky_relu(x, (lower + upper) / 2)",
                f"evaluation: the output is not leaky_relu(x, (lower + upper) / 2) ({same[0].message})")
        d.check(same[1].passed, "evaluation: the noise is the input's",
                f"evaluation: the noise output is not the noise input ({same[1].message})")
        bad = [s.mismatch_fraction for s in same if not s.passed]
        return d.result(n, bad[0] if bad else None)
    xs, o, r = x.reshape(-1), out.reshape(-1), noise.reshape(-1)
    neg = xs <= 0
    kept = compare_tensor(o[~neg], xs[~neg])
    if not d.check(kept.passed and bool((r[~neg] == 1).all()), "x > 0: the output x and the noise 1",
                   f"where x > 0 (or NaN) the output is not x or the noise is not 1 ({kept.message})"):
        return d.result(n, kept.mismatch_fraction)
    lower, upper = params["lower"], params["upper"]
    rel = _rounding(noise.dtype)
    slope = r[neg].double()
    inside = (slope >= lower - rel * abs(lower)) & (slope <= upper + rel * abs(upper))
    if not d.check(bool(inside.all()), f"x <= 0: the noise in [{lower:g}, {upper:g}]",
                   f"{int((~inside).sum())} noise values where x <= 0 are outside [{lower:g}, {upper:g}]"):
        return d.result(n, float((~inside).sum()) / n)
    # torch multiplies by the slope before rounding it into the noise: compared with rounding
    scaled = compare_tensor(o[neg], (xs[neg].double() * slope).to(out.dtype))
    if not d.check(scaled.passed, "x <= 0: the output x * noise",
                   f"where x <= 0 the output is not x * noise with its own noise ({scaled.message})"):
        return d.result(n, scaled.mismatch_fraction)
    k = slope.numel()
    if k and upper > lower:
        res = rel * max(abs(lower), abs(upper)) / (upper - lower)
        u = (slope - lower) / (upper - lower)
        d.near("mean of the slope in [0, 1]", float(u.mean()), 0.5, SIGMAS * math.sqrt(1 / 12 / k) + res)
        d.ks(f"uniform [{lower:g}, {upper:g}]", u, lambda v: v.clamp(0, 1), res)
    return d.result(n)


def _permutation(t: torch.Tensor, d: _Draws) -> None:
    x = t.reshape(-1).double()
    n = x.numel()
    if not d.check(torch.equal(x.sort().values, torch.arange(n, dtype=torch.float64)), f"a permutation of range({n})",
                   f"not a permutation of range({n})"):
        return
    fixed = int((x == torch.arange(n, dtype=torch.float64)).sum())
    d.check(fixed <= 11, f"{fixed} fixed points ≤ 11", f"{fixed} fixed points (a random permutation has about 1)")
    if n >= 40:
        pos = torch.arange(n, dtype=torch.float64)
        r = float(torch.corrcoef(torch.stack([pos, x]))[0, 1])
        d.near("position-value correlation", r, 0.0, SIGMAS / math.sqrt(n - 1))

