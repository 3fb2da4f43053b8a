"""Special functions and float bit-level ops torch.export leaves in graphs (no core-ATen
decomposition): erfc, erfcx, erfinv, lgamma, digamma, polygamma, the modified Bessel functions
i0/i0e/i1/i1e (and torch.special's modified_bessel_i0/i1), ndtri, angle, the Hermite, Laguerre and
Legendre polynomials, copysign, fmax/fmin, hypot, signbit, nextafter, ldexp, frexp, round(decimals).

Everything computes in f32 with algorithms accurate to a few ulp over the whole domain: erfc
and erfcx through ``(1 + 2x)·erfcx(x)`` as a polynomial in ``(x - 2)/(x + 2)`` (no cancellation
for large x) and an ``exp(-x²)`` that splits x so that x² is exact; lgamma through
``lgamma(2 + z) = z·P(z)`` (relative accuracy at its zeros 1 and 2) and reflection with an
exactly reduced ``sin(πx)`` for negative x; digamma through ``(x - x₀)·Q(x)`` around its zero
x₀ and reflection for negative x. The polynomials were fitted (least squares on Chebyshev nodes,
reweighted towards minimax) against mpmath; their f32 evaluation stays within 3 ulp of it.
Values at poles, infinities and NaN follow torch's CPU kernels, quirks included (noted where
they are not the mathematical limit).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tapml.platforms.wgsl.codegen import Value, ctype, lit, round_low
from tapml.platforms.wgsl.elementwise import FLOAT_EDGES, SHAPES, elementwise, typed
from tapml.platforms.wgsl.helpers import HELPERS, horner as _horner
from tapml.platforms.wgsl.registry import ALL, ALL_FLOAT, ALL_INT, rand, randbool, randint, register

#: float32 and the integer and bool dtypes (computed in f32), without float16/bfloat16
F32_INT_BOOL = ("float32",) + ALL_INT + ("bool",)


# lgamma(2 + z) / z on [-0.5, 0.5]
_LGAMMA2 = (0.42278432846069336, 0.32246702909469604, -0.0673523023724556, 0.02058080956339836,
            -0.007385552860796452, 0.0028904976788908243, -0.0011927153682336211, 0.0005098488763906062,
            -0.00022349474602378905, 9.824115841183811e-05, -4.3433086830191314e-05, 2.4376589863095433e-05,
            -1.2497321222326718e-05)
# sin(pi t) / t as a polynomial in t² on t in [0, 0.5]
_SINPI = (3.1415927410125732, -5.167712688446045, 2.5501632690429688, -0.5992512106895447, 0.08204660564661026,
          -0.007023140788078308)
# (digamma(1.5 + u) - digamma(A)) / (1.5 + u - A) on u in [-0.5, 0.5]; A the f32 nearest the positive zero of
# digamma. digamma(x) = (x - A)·Q + digamma(A): x - A is exact near the zero, and no second constant is
# subtracted from it (a driver may fold (x - hi) - lo into x - (hi + lo)).
_DIGAMMA = (0.9510558843612671, -0.42362743616104126, 0.240542471408844, -0.14840520918369293, 0.09498957544565201,
            -0.06191302835941315, 0.040743425488471985, -0.027098972350358963, 0.01807786151766777,
            -0.011109759099781513, 0.007076457608491182, -0.007674077525734901, 0.005543258972465992)
_DIGAMMA_ROOT = (1.4616321325302124, -1.203605254910667e-08)  # A, digamma(A)
# sqrt(x) e^-x I0(x) and sqrt(x) e^-x I1(x) as polynomials in u = 1/x, x >= 8
_I0_LARGE = (0.3989422917366028, 0.04986787959933281, 0.028036491945385933, 0.030076369643211365,
             0.01889922097325325, 0.5088383555412292, -3.355988025665283, 14.73879337310791, -9.157395362854004,
             -7.505792617797852, -2.8235623836517334)
_I1_LARGE = (0.3989422917366028, -0.1496034562587738, -0.04673561453819275, -0.041828226298093796,
             -0.030106619000434875, -0.5491210222244263, 3.4335451126098633, -14.954970359802246, 7.5160627365112305,
             6.594213485717773, 2.519353151321411)
# I0(x) and 2 I1(x)/x for |x| <= 8: their Taylor series in y = x²/4 (positive terms: stable in f32)
_I0_SMALL = tuple(1.0 / math.factorial(k) ** 2 for k in range(17))
_I1_SMALL = tuple(1.0 / (math.factorial(k) * math.factorial(k + 1)) for k in range(17))
# (2j)! / B_2j: the Euler-Maclaurin tail of the Hurwitz zeta function (as in Cephes' zeta)
_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9)

# erfinv(y)/y / sqrt(w) as a polynomial in u = 1/sqrt(w) - 1/4, w = -log(1 - y²) in [5, 104]
_NDTRI_TAIL = (0.9599459171295166, -0.19818830490112305, 0.08065272122621536, 0.56620192527771, -0.5827299952507019,
               5.758723258972168, 39.386322021484375, 79.04246520996094, -1072.910888671875, -3419.599365234375,
               17646.263671875, 40504.875, -165742.953125)

_INF, _NAN = "tap_bits_f32(0x7f800000u)", "tap_bits_f32(0x7fc00000u)"


def _nextafter_bits(name: str, step: int) -> str:
    """WGSL of ``name(a, b)``: the f32 whose bits are ``step`` from a's towards b (1 for float32;
    2**16 for bfloat16, whose values are the high halves of f32s)."""
    return f"""
fn {name}(a: f32, b: f32) -> f32 {{
  if (tap_isnan(a) || tap_isnan(b)) {{ return a + b; }}
  let ua = bitcast<u32>(a);
  let ub = bitcast<u32>(b);
  let ka = select(i32(ua), -i32(ua & 0x7fffffffu), (ua >> 31u) == 1u);
  let kb = select(i32(ub), -i32(ub & 0x7fffffffu), (ub >> 31u) == 1u);
  if (ka == kb) {{ return b; }}
  if ((ua & 0x7fffffffu) == 0u) {{ return bitcast<f32>(select({step}u, {0x80000000 + step}u, kb < ka)); }}
  return bitcast<f32>(select(ua - {step}u, ua + {step}u, (ka < kb) == ((ua >> 31u) == 0u)));
}}"""


_SPECIAL_HELPERS = {
    "tap_exp_x2": (("tap_exp_acc", "tap_bits_f32"), f"""
fn tap_exp_x2(x: f32) -> f32 {{
  let a = abs(x);
  if (a > 9.5) {{ return {_INF}; }}
  let h = bitcast<f32>(bitcast<u32>(a) & 0xfffff000u);
  let l = a - h;
  return tap_exp_acc(h * h) * tap_exp_acc(l * (a + h));
}}"""),
    # sin(pi t) for t in [0, 0.5]
    "tap_sinpi_half": ((), f"""
fn tap_sinpi_half(t: f32) -> f32 {{
  let s = t * t;
  return t * {_horner("s", _SINPI)};
}}"""),
    "tap_erfcx": (("tap_erfcx_pos", "tap_exp_x2", "tap_isnan"), """
fn tap_erfcx(x: f32) -> f32 {
  if (tap_isnan(x)) { return x; }
  if (x >= 0.0) { return tap_erfcx_pos(x); }
  return 2.0 * tap_exp_x2(x) - tap_erfcx_pos(-x);
}"""),
    # M. Giles, "Approximating the erfinv function" (GPU Computing Gems, 2011), single precision
    "tap_erfinv": (("tap_bits_f32", "tap_isnan", "tap_log"), f"""
fn tap_erfinv(x: f32) -> f32 {{
  let a = abs(x);
  if (tap_isnan(x) || a > 1.0) {{ return {_NAN}; }}
  if (a == 1.0) {{ return select({_INF}, -{_INF}, x < 0.0); }}
  var w = -tap_log((1.0 - a) * (1.0 + a));
  var p: f32;
  if (w < 5.0) {{
    w = w - 2.5;
    p = {_horner("w", (1.50140941, 0.246640727, -0.00417768164, -0.00125372503, 0.00021858087, -4.39150654e-06,
                      -3.5233877e-06, 3.43273939e-07, 2.81022636e-08))};
  }} else {{
    w = sqrt(w) - 3.0;
    p = {_horner("w", (2.83297682, 1.00167406, 0.00943887047, -0.0076224613, 0.00573950773, -0.00367342844,
                      0.00134934322, 0.000100950558, -0.000200214257))};
  }}
  return p * x;
}}"""),
    # lgamma(2 + z) for |z| <= 0.5
    "tap_lgamma2": ((), f"""
fn tap_lgamma2(z: f32) -> f32 {{
  return z * {_horner("z", _LGAMMA2)};
}}"""),
    "tap_lgamma_pos": (("tap_lgamma2", "tap_log1p", "tap_log"), """
fn tap_lgamma_pos(x: f32) -> f32 {
  if (x >= 8.0) {
    let l = log(x);
    let r = 1.0 / x;
    let r2 = r * r;
    let c = r * (0.0833333333 - r2 * (0.00277777778 - r2 * (0.000793650794 - r2 * 0.000595238095)));
    return x * (l - 1.0) - 0.5 * l + 0.918938533 + c;
  }
  if (x >= 2.5) {
    var y = x;
    var p = 1.0;
    loop {
      if (y < 2.5) { break; }
      y = y - 1.0;
      p = p * y;
    }
    return tap_lgamma2(y - 2.0) + log(p);
  }
  if (x >= 1.5) { return tap_lgamma2(x - 2.0); }
  if (x >= 0.5) {
    let z = x - 1.0;
    return tap_lgamma2(z) - tap_log1p(z);
  }
  return tap_lgamma2(x) - tap_log1p(x) - tap_log(x);
}"""),
    "tap_lgamma": (("tap_lgamma_pos", "tap_sinpi_half", "tap_isnan", "tap_bits_f32", "tap_log"), f"""
fn tap_lgamma(x: f32) -> f32 {{
  if (tap_isnan(x)) {{ return x; }}
  let a = abs(x);
  if (a > 3.4028234e38 || (bitcast<u32>(x) & 0x7fffffffu) == 0u) {{ return {_INF}; }}
  if (x > 0.0) {{ return tap_lgamma_pos(x); }}
  let r = abs(x - round(x));
  if (r == 0.0) {{ return {_INF}; }}
  return 1.14472988585 - tap_log(a) - tap_log(tap_sinpi_half(r)) - tap_lgamma_pos(a);
}}"""),
    # digamma: torch gives -inf at +0 and +inf at -0, NaN at negative integers and -inf
    "tap_digamma": (("tap_sinpi_half", "tap_isnan", "tap_bits_f32"), f"""
fn tap_digamma(x0: f32) -> f32 {{
  if (tap_isnan(x0)) {{ return x0; }}
  if (x0 > 3.4028234e38) {{ return x0; }}
  if (x0 < -3.4028234e38) {{ return {_NAN}; }}
  if ((bitcast<u32>(x0) & 0x7fffffffu) == 0u) {{ return select(-{_INF}, {_INF}, (bitcast<u32>(x0) >> 31u) == 1u); }}
  var x = x0;
  var res = 0.0;
  if (x < 0.0) {{
    let r = x - round(x);
    if (r == 0.0) {{ return {_NAN}; }}
    let t = abs(r);
    let cot = tap_sinpi_half(0.5 - t) / tap_sinpi_half(t);
    res = select(-3.14159265, 3.14159265, r < 0.0) * cot;
    x = 1.0 - x;
  }}
  if (x < 1.0) {{
    res = res - 1.0 / x;
    x = x + 1.0;
  }}
  loop {{
    if (x < 2.0 || x >= 6.0) {{ break; }}
    x = x - 1.0;
    res = res + 1.0 / x;
  }}
  if (x >= 6.0) {{
    let r = 1.0 / x;
    let r2 = r * r;
    return res + log(x) - 0.5 * r - r2 * (0.0833333333 - r2 * (0.00833333333 - r2 * (0.00396825397 - r2 * (0.00416666667 - r2 * 0.00757575758))));
  }}
  let u = x - 1.5;
  return res + ((x - {_DIGAMMA_ROOT[0]!r}) * {_horner("u", _DIGAMMA)} + {_DIGAMMA_ROOT[1]!r});
}}"""),
    # a^-s for an integer s >= 1 by repeated squaring (of 1/a below 1, so that nothing overflows early)
    "tap_powneg": ((), """
fn tap_powneg(a: f32, s: i32) -> f32 {
  var b = select(a, 1.0 / a, abs(a) < 1.0);
  var r = 1.0;
  var e = s;
  loop {
    if (e == 0) { break; }
    if ((e & 1) != 0) { r = r * b; }
    b = b * b;
    e = e >> 1u;
  }
  return select(1.0 / r, r, abs(a) < 1.0);
}"""),
    # Hurwitz zeta(s, q) for an integer s >= 2, as Cephes' zeta (which torch uses): direct sum until
    # the argument passes 9, then Euler-Maclaurin; +inf at non-positive integers q
    "tap_hzeta": (("tap_powneg", "tap_bits_f32"), f"""
fn tap_hzeta(s: i32, q: f32) -> f32 {{
  if (q <= 0.0 && q == floor(q)) {{ return {_INF}; }}
  let sf = f32(s);
  var sum = tap_powneg(q, s);
  var a = q;
  var b = 0.0;
  var i = 0;
  loop {{
    if (i >= 9 && a > 9.0) {{ break; }}
    i = i + 1;
    a = a + 1.0;
    b = tap_powneg(a, s);
    sum = sum + b;
    if (abs(b) <= 5.96e-8 * abs(sum)) {{ return sum; }}
  }}
  let w = a;
  sum = sum + b * w / (sf - 1.0) - 0.5 * b;
  var fac = 1.0;
  var k = 0.0;
{"".join(f'''  fac = fac * (sf + k);
  b = b / w;
  sum = sum + fac * b / {a!r};
  k = k + 1.0;
  fac = fac * (sf + k);
  b = b / w;
  k = k + 1.0;
''' for a in _ZETA_A)}  return sum;
}}"""),
    "tap_i0e_large": ((), f"""
fn tap_i0e_large(a: f32) -> f32 {{
  let u = 1.0 / a;
  return {_horner("u", _I0_LARGE)} * inverseSqrt(a);
}}"""),
    "tap_i1e_large": ((), f"""
fn tap_i1e_large(a: f32) -> f32 {{
  let u = 1.0 / a;
  return {_horner("u", _I1_LARGE)} * inverseSqrt(a);
}}"""),
    "tap_i0_small": ((), f"""
fn tap_i0_small(x: f32) -> f32 {{
  let y = 0.25 * x * x;
  return {_horner("y", _I0_SMALL)};
}}"""),
    # I1(x) for |x| <= 8
    "tap_i1_small": ((), f"""
fn tap_i1_small(x: f32) -> f32 {{
  let y = 0.25 * x * x;
  return 0.5 * x * {_horner("y", _I1_SMALL)};
}}"""),
    "tap_nextafter_f32": (("tap_isnan",), _nextafter_bits("tap_nextafter_f32", 1)),
    # bfloat16 is the high half of an f32: its neighbours are 2^16 apart in the f32's bits
    "tap_nextafter_bf16": (("tap_isnan",), _nextafter_bits("tap_nextafter_bf16", 0x10000)),
    # float16 neighbours: step the half's bits (a, b are exact halves), then widen them in software
    # (a driver may flush half subnormals)
    "tap_nextafter_f16": (("tap_isnan", "tap_f16_bits"), """
fn tap_nextafter_f16(a: f32, b: f32) -> f32 {
  if (tap_isnan(a) || tap_isnan(b)) { return a + b; }
  let ua = tap_f16_bits(a);
  let ub = tap_f16_bits(b);
  let ka = select(i32(ua), -i32(ua & 0x7fffu), (ua >> 15u) == 1u);
  let kb = select(i32(ub), -i32(ub & 0x7fffu), (ub >> 15u) == 1u);
  if (ka == kb) { return b; }
  var h: u32;
  if ((ua & 0x7fffu) == 0u) { h = select(1u, 0x8001u, kb < ka); }
  else { h = select(ua - 1u, ua + 1u, (ka < kb) == ((ua >> 15u) == 0u)); }
  let e = (h >> 10u) & 31u;
  let m = h & 1023u;
  var v: f32;
  if (e == 0u) { v = f32(m) * 5.9604644775390625e-08; }
  else { v = bitcast<f32>(((e + 112u) << 23u) | (m << 13u)); }
  return select(v, -v, (h >> 15u) == 1u);
}"""),
    # x * 2^n for an integer n, rounded once (musl's scalbnf)
    "tap_scalbn": ((), """
fn tap_scalbn(x: f32, n0: i32) -> f32 {
  var y = x;
  var n = n0;
  if (n > 127) {
    y = y * 1.7014118346046923e38;
    n = n - 127;
    if (n > 127) {
      y = y * 1.7014118346046923e38;
      n = min(n - 127, 127);
    }
  } else if (n < -126) {
    y = y * 1.9721522630525295e-31;
    n = n + 102;
    if (n < -126) {
      y = y * 1.9721522630525295e-31;
      n = max(n + 102, -126);
    }
  }
  return y * bitcast<f32>(u32(n + 127) << 23u);
}"""),
    # 2^e as exp2f gives it: exact for integers (0 below 2^-149 after rounding, Inf from 2^128)
    "tap_exp2_exact": (("tap_scalbn",), """
fn tap_exp2_exact(e: f32) -> f32 {
  if (e == floor(e) && abs(e) < 512.0) { return tap_scalbn(1.0, i32(e)); }
  return exp2(e);
}"""),
    "tap_hypot": (("tap_isnan", "tap_bits_f32"), f"""
fn tap_hypot(x: f32, y: f32) -> f32 {{
  let a = abs(x);
  let b = abs(y);
  if (a > 3.4028234e38 || b > 3.4028234e38) {{ return {_INF}; }}
  if (tap_isnan(a) || tap_isnan(b)) {{ return a + b; }}
  let m = max(a, b);
  let n = min(a, b);
  if ((bitcast<u32>(m) & 0x7fffffffu) == 0u) {{ return 0.0; }}
  let r = n / m;
  return m * sqrt(1.0 + r * r);
}}"""),
    "tap_fmax": (("tap_isnan",), """
fn tap_fmax(a: f32, b: f32) -> f32 {
  if (tap_isnan(a)) { return b; }
  if (tap_isnan(b)) { return a; }
  return max(a, b);
}"""),
    "tap_fmin": (("tap_isnan",), """
fn tap_fmin(a: f32, b: f32) -> f32 {
  if (tap_isnan(a)) { return b; }
  if (tap_isnan(b)) { return a; }
  return min(a, b);
}"""),
    "tap_frexp_exp": ((), """
fn tap_frexp_exp(x: f32) -> i32 {
  let u = bitcast<u32>(x) & 0x7fffffffu;
  if (u == 0u || u >= 0x7f800000u) { return 0; }
  let e = i32(u >> 23u);
  if (e == 0) { return i32(31u - countLeadingZeros(u)) - 148; }
  return e - 126;
}"""),
    "tap_frexp_mant": ((), """
fn tap_frexp_mant(x: f32) -> f32 {
  let b = bitcast<u32>(x);
  let u = b & 0x7fffffffu;
  if (u == 0u || u >= 0x7f800000u) { return x; }
  var m = u & 0x7fffffu;
  if ((u >> 23u) == 0u) { m = (u << (countLeadingZeros(u) - 8u)) & 0x7fffffu; }
  return bitcast<f32>((b & 0x80000000u) | (126u << 23u) | m);
}"""),
    # the inverse normal CDF through erfinv's w = -log(1 - y²) with y = 1 - 2q and q = min(p, 1 - p), taken as
    # -log(q) - log(4(1 - q)) so that tiny (denormal) q keep their accuracy: Giles' fit for w < 5, beyond it
    # erfinv(y)/y = sqrt(w)·P(1/sqrt(w)) (fitted against mpmath up to q = 2^-149)
    "tap_ndtri": (("tap_isnan", "tap_log", "tap_bits_f32"), f"""
fn tap_ndtri(p: f32) -> f32 {{
  let b = bitcast<u32>(p);
  if (tap_isnan(p) || b > 0x80000000u || p > 1.0) {{ return {_NAN}; }}
  if ((b & 0x7fffffffu) == 0u) {{ return -{_INF}; }}
  if (p == 1.0) {{ return {_INF}; }}
  let q = select(p, 1.0 - p, p > 0.5);
  let y = select(2.0 * q - 1.0, 1.0 - 2.0 * q, p > 0.5);
  let w = -tap_log(q) - tap_log(4.0 * (1.0 - q));
  if (w < 5.0) {{
    let v = w - 2.5;
    return 1.41421356 * y * {_horner("v", (1.50140941, 0.246640727, -0.00417768164, -0.00125372503, 0.00021858087,
                                           -4.39150654e-06, -3.5233877e-06, 3.43273939e-07, 2.81022636e-08))};
  }}
  let s = sqrt(w);
  let u = 1.0 / s - 0.25;
  return 1.41421356 * y * s * {_horner("u", _NDTRI_TAIL)};
}}"""),
}
for _name in _SPECIAL_HELPERS:
    if _name in HELPERS:
        raise ValueError(f"WGSL helper {_name} is defined twice")
HELPERS.update(_SPECIAL_HELPERS)


# --- samples -----------------------------------------------------------------------------

def _unary(lo, hi, edges=(), dtypes=ALL_FLOAT, extra=()):
    """Samples of a unary op: float32 in [lo, hi) of several shapes, float32 with the float edge
    values plus the op's own ``edges`` (poles, zeros, overflow points), ``extra`` ranges
    ``(lo, hi)`` of their own, and every integer and bool dtype the op claims."""
    def samples():
        out = [((rand(*s, lo=lo, hi=hi),), {}) for s in SHAPES]
        out += [((rand(4, 9, lo=a, hi=b),), {}) for a, b in extra]
        special = FLOAT_EDGES + tuple(edges)
        out.append(((typed((len(special) + 5,), "float32", lo, hi, special),), {}))
        return out + [((typed((4, 5), d, lo, hi),), {}) for d in dtypes if d in ALL_INT + ("bool",)]
    return samples


def _unary_op(helper: str, cost: int = 8):
    def lower(pb, node, x):
        return [elementwise(pb, node, [x], lambda k, a: f"{k.need(helper)}({a})", compute="f32", cost=cost)]
    return lower


_UNARY = {  # op -> (helper, dtypes, sample range, edge values, extra ranges)
    "aten.erfc.default": ("tap_erfc", ALL, (-4, 4), (0.5, -0.5, 0.49999997, 5.0, 9.0, 9.9, 10.1, 12.0, -6.0, 1e30, -1e30),
                          ((-12, 12), (0.3, 0.7))),
    "aten.special_erfcx.default": ("tap_erfcx", F32_INT_BOOL, (-3, 10),
                                   (0.5, -0.5, 2.0, 9.0, -9.0, 9.3, -9.5, 1e5, 1e12, 1e30, -1e30, 3e38), ((-9, 0), (10, 1e4))),
    "aten.erfinv.default": ("tap_erfinv", ALL, (-1, 1), (1.0, -1.0, 1.5, -2.0, 0.99999994, -0.9999999, 0.5, 1e-30),
                            ((0.99, 1.0), (-1e-3, 1e-3))),
    "aten.lgamma.default": ("tap_lgamma", ALL, (-8, 12),
                            (1.0, 2.0, -1.0, -2.0, -3.5, 1.0000001, 0.99999994, 2.0000002, 1.9999999, 1e30, -1e30,
                             3e38, 4.2e36, 1e-30, -1e-30, -2.4570247, 1.4616321), ((0, 3), (-4, 0), (10, 1e4))),
    "aten.special_ndtri.default": ("tap_ndtri", F32_INT_BOOL, (0, 1),
                                   (1.0, 0.5, 1e-30, 1e-45, 1e-38, 0.9999999, 0.99999994, 0.25, 0.75, -0.5, 1.5, 1e30, 0.02,
                                    0.0067, 0.9933), ((0, 1e-6), (0.999, 1.0), (0.4, 0.6))),
    "aten.digamma.default": ("tap_digamma", ALL, (-8, 12),
                             (1.0, 2.0, -1.0, -2.0, -3.5, 1.4616321, 1.4616322, 1e30, -1e30, 3e38, 1e-30, -1e-30,
                              -0.5, 0.5), ((0, 3), (-4, 0), (10, 1e4))),
}


def _i0(k, a):
    return (f"select(select(tap_exp_acc(abs({a})) * tap_i0e_large(abs({a})), "
            f"tap_i0_small({a}), abs({a}) <= 8.0), {_NAN}, abs({a}) > 3.4028234e38)")


def _i0e(k, a):
    return f"select(tap_i0e_large(abs({a})), tap_i0_small({a}) * tap_exp_acc(-abs({a})), abs({a}) <= 8.0)"


def _i1(k, a):
    large = f"(tap_exp_acc(abs({a})) * tap_i1e_large(abs({a})))"
    return (f"select(select(select({large}, -{large}, {a} < 0.0), tap_i1_small({a}), abs({a}) <= 8.0), {_NAN}, "
            f"abs({a}) > 3.4028234e38)")


def _i1e(k, a):
    large = f"tap_i1e_large(abs({a}))"
    return f"select(select({large}, -{large}, {a} < 0.0), tap_i1_small({a}) * tap_exp_acc(-abs({a})), abs({a}) <= 8.0)"


# torch's i0 and i1 are exp(|x|) times i0e/i1e: Inf once exp(|x|) overflows f32 (|x| > 88.72, although I0 stays
# finite up to 91.9) and NaN at +-Inf (Inf/Inf in Cephes' chbevl); i0e and i1e give +-0 there
_BESSEL = {"aten.i0.default": _i0, "aten.special_i0e.default": _i0e, "aten.special_i1.default": _i1,
           "aten.special_i1e.default": _i1e}
_BESSEL_EDGES = (8.0, -8.0, 7.9999995, 8.000001, 88.0, 91.0, 92.0, -92.0, 1e30, -1e30, 1e-30, 0.5)

for _op, (_helper, _dtypes, (_lo, _hi), _edges, _extra) in _UNARY.items():
    register(_op, _dtypes, samples=_unary(_lo, _hi, _edges, _dtypes, _extra))(_unary_op(_helper))

# torch.special's modified_bessel_i0/i1 (float32 and integer inputs only) agree with i0/i1, Inf and NaN included
_MODIFIED_BESSEL = {"aten.special_modified_bessel_i0.default": _i0, "aten.special_modified_bessel_i1.default": _i1}

for _op, _expr in {**_BESSEL, **_MODIFIED_BESSEL}.items():
    def _lower_bessel(pb, node, x, _expr=_expr):
        def fn(k, a):
            for h in ("tap_exp_acc", "tap_i0e_large", "tap_i1e_large", "tap_i0_small", "tap_i1_small", "tap_bits_f32"):
                k.need(h)
            return _expr(k, a)
        return [elementwise(pb, node, [x], fn, compute="f32", cost=12)]
    _dtypes = ALL if _op in _BESSEL else F32_INT_BOOL
    register(_op, _dtypes, samples=_unary(-12, 12, _BESSEL_EDGES, _dtypes, ((-100, 100), (-1, 1))))(_lower_bessel)


def _angle(k, a):
    # pi for every negative x (-0 excepted: its bits are exactly 0x80000000), NaN kept
    return f"select(select(0.0, 3.14159265, bitcast<u32>({a}) > 0x80000000u), {a}, {k.need('tap_isnan')}({a}))"


register("aten.angle.default", ALL, samples=_unary(-3, 3, (1e30, -1e30, 1.0, -1.0), ALL))(
    lambda pb, node, x: [elementwise(pb, node, [x], _angle, compute="f32")])


# --- polygamma ---------------------------------------------------------------------------

def _polygamma_check(node):
    n = node.args[0] if node.args else node.kwargs.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return f"polygamma takes an order n >= 0 given as a constant, not {n!r}"
    return None


def _polygamma_samples():
    out = []
    # torch's trigamma (n = 1) gives a finite rounding artefact at negative integers (sin(pi * x)
    # of the rounded pi * x), not the pole: its samples keep off negative integers and -1e30.
    edges1 = (1.0, 2.0, 0.5, -0.5, -2.5, 1e30, 1e-30, -1e-30, 3e38, 1e4)
    for n in (0, 1, 2, 3, 5):
        out += [((n, rand(*s, lo=-6, hi=10)), {}) for s in SHAPES[:2]]
        out.append(((n, rand(4, 9, lo=0.05, hi=30)),
                     {}))
        edges = edges1 if n == 1 else edges1 + (-1.0, -2.0, -1e30)
        out.append(((n, typed((len(FLOAT_EDGES) + len(edges) + 3,), "float32", -6, 10, FLOAT_EDGES + edges)), {}))
    out.append(((12, rand(3, 5, lo=0.2, hi=20)), {}))
    out += [((2, typed((4, 5), d, -6, 10)), {}) for d in ALL_INT + ("bool",)]
    return out


@register("aten.polygamma.default", ALL, samples=_polygamma_samples, check=_polygamma_check)
def polygamma(pb, node, n, x):
    if n == 0:
        return [elementwise(pb, node, [x], lambda k, a: f"{k.need('tap_digamma')}({a})", compute="f32", cost=8)]
    if n == 1:  # the reflection pi²/sin²(pi x) - zeta(2, 1 - x) below 1/2, as torch's trigamma
        def fn(k, a):
            k.need("tap_hzeta"), k.need("tap_sinpi_half")
            s = f"tap_sinpi_half(abs({a} - round({a})))"
            return (f"select(select(tap_hzeta(2, {a}), 9.8696044 / ({s} * {s}) - tap_hzeta(2, 1.0 - {a}), {a} < 0.5), "
                    f"0.0, {a} > 3.4028234e38)")
        return [elementwise(pb, node, [x], fn, compute="f32", cost=16)]
    fact = float(torch.tensor(float(math.factorial(n)) if n < 40 else math.inf, dtype=torch.float32))
    sign = 1.0 if n % 2 else -1.0

    def fn(k, a):
        k.need("tap_hzeta")
        # torch's zeta(s, +inf) meets 0 * Inf in its Euler-Maclaurin tail: NaN
        return f"select({lit(sign * fact, 'f32')} * tap_hzeta({n + 1}, {a}), {_NAN}, {a} > 3.4028234e38)"
    return [elementwise(pb, node, [x], fn, compute="f32", cost=16)]


# --- binary and bit-level ops ------------------------------------------------------------

def _binary(lo=-3.0, hi=3.0, dtypes=ALL_FLOAT, rhs_scalar=None):
    """Samples of a binary float op: broadcasting float32 pairs, the edge values against each
    other (every pair), and each claimed integer/bool dtype."""
    def samples():
        edges = torch.tensor(FLOAT_EDGES + (1.0, -1.0, 3e38, -3e38, 1e-38), dtype=torch.float32)
        grid_a, grid_b = torch.meshgrid(edges, edges, indexing="ij")
        out = [((rand(3, 5, lo=lo, hi=hi), rand(3, 5, lo=lo, hi=hi)), {}), ((rand(2, 1, 4, lo=lo, hi=hi), rand(3, 1, lo=lo, hi=hi)), {}),
               ((rand(2, 3, 33, lo=lo, hi=hi), rand(33, lo=lo, hi=hi)), {}),
               ((grid_a.contiguous(), grid_b.contiguous()), {}), ((typed((5, 7), "float32", lo, hi), rand(5, 7, lo=lo, hi=hi)), {})]
        ints = [d for d in dtypes if d in ALL_INT + ("bool",)]
        out += [((typed((4, 5), d, lo, hi), typed((5,), d, lo, hi, edges=False)), {}) for d in ints]
        if ints:
            out.append(((randint(4, 5, lo=-5, hi=5), rand(5)), {}))
        return out
    return samples


def _binary_op(helper: str):
    def lower(pb, node, a, b):
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"{k.need(helper)}({x}, {y})", compute="f32", cost=4)]
    return lower


register("aten.hypot.default", ALL_FLOAT, samples=_binary(-1e3, 1e3))(_binary_op("tap_hypot"))


@register(["aten.fmax.default", "aten.fmin.default"], ALL, samples=_binary(dtypes=ALL))
def fmax_fmin(pb, node, a, b):
    big = node.op == "aten.fmax.default"
    t = ctype(node.outputs[0].dtype)
    if t == "f32":
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"{k.need('tap_fmax' if big else 'tap_fmin')}({x}, {y})")]
    if t == "bool":
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"({x} {'||' if big else '&&'} {y})")]
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"{'max' if big else 'min'}({x}, {y})")]


def _copysign_samples():
    return _binary(dtypes=ALL)() + [((rand(3, 5), v), {}) for v in (-1.0, 2.5, -0.0, 0.0, math.inf, -math.inf, 3, -2, True)] + [
        ((typed((5, 7), "float32"), -0.0), {}), ((randbool(4, 5), -1), {})] + [((typed((4, 5), d), -1.5), {}) for d in ALL_INT]


@register(["aten.copysign.Tensor", "aten.copysign.Scalar"], ALL, samples=_copysign_samples)
def copysign(pb, node, a, b):
    if not isinstance(b, Value):  # the sign of a Python number, -0.0 included
        neg = math.copysign(1.0, float(b)) < 0
        bits = "0x80000000u" if neg else "0u"
        return [elementwise(pb, node, [a], lambda k, x: f"bitcast<f32>((bitcast<u32>({x}) & 0x7fffffffu) | {bits})",
                            compute="f32")]
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"bitcast<f32>((bitcast<u32>({x}) & 0x7fffffffu) | "
                        f"(bitcast<u32>({y}) & 0x80000000u))", compute="f32")]


def _nextafter_samples():
    edges = torch.tensor(FLOAT_EDGES + (1.0, -1.0, 65504.0, 6e-8, 1e-45, -1e-45, 3.4028235e38, 1.1754944e-38),
                         dtype=torch.float32)
    grid_a, grid_b = torch.meshgrid(edges, edges, indexing="ij")
    return [((rand(3, 5), rand(3, 5)), {}), ((rand(2, 1, 4), rand(3, 1)), {}), ((rand(7), rand(7).round()), {}),
            ((grid_a.contiguous(), grid_b.contiguous()), {})]


@register("aten.nextafter.default", ALL_FLOAT, samples=_nextafter_samples)
def nextafter(pb, node, a, b):
    helper = {"float16": "tap_nextafter_f16", "bfloat16": "tap_nextafter_bf16"}.get(node.outputs[0].dtype, "tap_nextafter_f32")
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"{k.need(helper)}({x}, {y})", compute="f32", cost=4)]


def _signbit_samples():
    return [((rand(3, 5),), {}), ((typed((5, 7), "float32"),), {}), ((rand(2, 3, 33),), {})] + [
        ((typed((4, 5), d),), {}) for d in ALL_INT + ("bool",)]


@register("aten.signbit.default", ALL, samples=_signbit_samples)
def signbit(pb, node, x):
    if x.ty == "f32":
        return [elementwise(pb, node, [x], lambda k, a: f"((bitcast<u32>({a}) >> 31u) == 1u)", compute="f32", result="bool")]
    if x.ty == "i32":
        return [elementwise(pb, node, [x], lambda k, a: f"({a} < 0)", compute="i32", result="bool")]
    return [elementwise(pb, node, [x], lambda k, a: "false", compute="bool")]


def _ldexp_samples():
    e_edges = torch.tensor([-150, -149, -140, -127, -126, 127, 128, 200, 0, 1, -1, -300, 300, 5, -5] * 3)
    return [((rand(3, 5), randint(3, 5, lo=-10, hi=10)), {}), ((rand(2, 1, 4), randint(3, 1, lo=-20, hi=20)), {}),
            ((typed((45,), "float32", -4, 4, FLOAT_EDGES + (1.0, 1.5, 3.0, 3e38, 1e-38, -1.5)), e_edges), {}),
            ((rand(3, 5), rand(3, 5, lo=-20, hi=20)), {}), ((rand(3, 5), rand(5, lo=-8, hi=8).round()), {}),
            ((rand(5, 7, lo=-4, hi=4), typed((5, 7), "float32", -20, 20)), {})] + [
        ((typed((4, 5), d, -9, 9), randint(5, lo=-6, hi=6, dtype=torch.int32)), {}) for d in ALL_INT + ("bool",)] + [
        ((rand(4, 5), typed((5,), d, -9, 9, edges=False)), {}) for d in ALL_INT]


@register("aten.ldexp.Tensor", ALL, samples=_ldexp_samples)
def ldexp(pb, node, x, e):
    dtype = node.outputs[0].dtype
    if e.ty == "i32":  # torch scales an integer exponent exactly (one rounding)
        return [elementwise(pb, node, [x, e], lambda k, a, n: f"{k.need('tap_scalbn')}({a}, {n})", compute="f32",
                            arg_types=("f32", "i32"), cost=3)]

    def fn(k, a, f):  # a float exponent: 2^e in the result's dtype (torch computes it there), then x * 2^e
        power = round_low(k, f"{k.need('tap_exp2_exact')}({f})", dtype)
        return f"({a} * {power})"
    return [elementwise(pb, node, [x, e], fn, compute="f32", cost=3)]


def _frexp_samples():
    return [((rand(3, 5, lo=-100, hi=100),), {}), ((rand(2, 3, 33),), {}),
            ((typed((20,), "float32", -5, 5, FLOAT_EDGES + (1.0, 0.5, -0.75, 3e38, 1e-45, 1.1754944e-38, 65504.0, 6e-8)),), {})]


@register("aten.frexp.Tensor", ALL_FLOAT, samples=_frexp_samples)
def frexp(pb, node, x):
    mant = elementwise(pb, node, [x], lambda k, a: f"{k.need('tap_frexp_mant')}({a})", compute="f32")
    exp_node = dataclasses.replace(node, outputs=[node.outputs[1]])
    expo = elementwise(pb, exp_node, [x], lambda k, a: f"{k.need('tap_frexp_exp')}({a})", compute="f32", result="i32")
    return [mant, expo]


def _round_samples():
    ties = torch.tensor([0.125, 0.375, 2.5, 25.0, 250.0, -0.125, 1.005, 0.15, 1e38, -1e38, 3.5, 4.5, 0.0, -0.0,
                         math.inf, math.nan])
    return [((rand(3, 5, lo=-100, hi=100),), {"decimals": d}) for d in (0, 1, 2, 3, -1, -2)] + [
        ((ties,), {"decimals": d}) for d in (1, 2, -1, 0)] + [
        # 10^40 overflows f32 (torch: NaN everywhere), not f64: the float16 tests' fp64 anchor needs finite inputs
        ((ties[:8],), {"decimals": d}) for d in (40, -40)] + [
        ((typed((5, 7), "float32", -50, 50),), {"decimals": 2}), ((rand(2, 3, 33, lo=-1e4, hi=1e4),), {"decimals": -3})]


@register("aten.round.decimals", ALL_FLOAT, samples=_round_samples)
def round_decimals(pb, node, x, decimals=0):
    """torch: nearbyint(x * 10^d) / 10^d, or nearbyint(x / 10^-d) * 10^-d for d < 0, in f32."""
    d = abs(int(decimals))
    if d >= 39:  # 10^d overflows f32: x * Inf / Inf (or x / Inf * Inf) is NaN for every x
        return [elementwise(pb, node, [x], lambda k, a: f"{k.need('tap_bits_f32')}(0x7fc00000u)", compute="f32")]
    p = lit(float(torch.tensor(10.0 ** d, dtype=torch.float32)), "f32")
    if decimals < 0:
        return [elementwise(pb, node, [x], lambda k, a: f"(round({a} / {p}) * {p})", compute="f32")]
    return [elementwise(pb, node, [x], lambda k, a: f"(round({a} * {p}) / {p})", compute="f32")]


# --- orthogonal polynomials --------------------------------------------------------------

# torch's recurrences (ATen/native/Math.h), operation for operation: n is truncated to an integer as
# static_cast<int64_t> does (NaN, +-Inf and |n| >= 2^63 give INT64_MIN on x86, hermite_h's -1: both 0 here);
# the f32 count k stays exact below 2^24, so the unbounded recurrences stop at _POLY_MAX_TERMS terms: NaN
# beyond (torch would take minutes per element there)
_POLY_MAX_TERMS = 1 << 20
_POLY_PRELUDE = f"""
  if (tap_isnan(n0) || abs(n0) >= 9.223372e18) {{ return 0.0; }}
  let n = trunc(n0);
  if (n < 0.0) {{ return 0.0; }}"""
_POLY_BODIES = {
    "aten.special_hermite_polynomial_h.default": ("tap_hermite_h", f"""
  if (n == 0.0) {{ return 1.0; }}
  if (n == 1.0) {{ return x + x; }}
  if (n > 128.0) {{ return {_NAN}; }}
  var p = 1.0;
  var q = x + x;
  var r = 0.0;
  var k = 2.0;
  loop {{
    if (k >= n + n) {{ break; }}
    r = (x + x) * q - k * p;
    p = q;
    q = r;
    k = k + 2.0;
  }}
  return r;"""),
    "aten.special_hermite_polynomial_he.default": ("tap_hermite_he", f"""
  if (n == 0.0) {{ return 1.0; }}
  if (n == 1.0) {{ return x; }}
  if (n > 128.0) {{ return {_NAN}; }}
  var p = 1.0;
  var q = x;
  var r = 0.0;
  var k = 1.0;
  loop {{
    if (k >= n) {{ break; }}
    r = x * q - k * p;
    p = q;
    q = r;
    k = k + 1.0;
  }}
  return r;"""),
    "aten.special_laguerre_polynomial_l.default": ("tap_laguerre_l", f"""
  if ((bitcast<u32>(x) & 0x7fffffffu) == 0u) {{ return 1.0; }}
  if (n == 0.0) {{ return 1.0; }}
  if (n == 1.0) {{ return 1.0 - x; }}
  var p = 1.0;
  var q = 1.0 - x;
  var r = q;
  var k = 1.0;
  loop {{
    if (k >= n || tap_isnan(q)) {{ break; }}
    if (k >= {float(_POLY_MAX_TERMS)!r}) {{ return {_NAN}; }}
    r = ((k + k + (1.0 - x)) * q - k * p) / (k + 1.0);
    p = q;
    q = r;
    k = k + 1.0;
  }}
  return r;"""),
    "aten.special_legendre_polynomial_p.default": ("tap_legendre_p", f"""
  if (abs(x) == 1.0) {{ return select(-1.0, 1.0, x > 0.0 || n - 2.0 * floor(0.5 * n) == 0.0); }}
  if (n == 0.0) {{ return 1.0; }}
  if (n == 1.0) {{ return x; }}
  var p = 1.0;
  var q = x;
  var r = q;
  var k = 1.0;
  loop {{
    if (k >= n || tap_isnan(q)) {{ break; }}
    if (k >= {float(_POLY_MAX_TERMS)!r}) {{ return {_NAN}; }}
    r = ((k + k + 1.0) * x * q - k * p) / (k + 1.0);
    p = q;
    q = r;
    k = k + 1.0;
  }}
  return r;"""),
}
for _op, (_name, _body) in _POLY_BODIES.items():
    if _name in HELPERS:
        raise ValueError(f"WGSL helper {_name} is defined twice")
    HELPERS[_name] = (("tap_isnan", "tap_bits_f32"), f"\nfn {_name}(x: f32, n0: f32) -> f32 {{{_POLY_PRELUDE}{_body}\n}}")


def _polynomial_samples(x_lo, x_hi):
    """Samples of a polynomial op p(x, n): float32 x of several shapes against small orders n, x's edge
    values against every n edge (negative, fractional, NaN, +-Inf, past hermite's limit of 128), and
    each integer and bool dtype."""
    def samples():
        n_small = torch.arange(0, 12, dtype=torch.float32)
        n_edges = torch.tensor([-1.0, -0.5, 0.0, 1.0, 2.7, 5.0, 6.0, 7.0, 9.0, 13.0, 25.0, 60.0, 128.0, 129.0, 300.0,
                                math.nan, math.inf, -math.inf, 1e30, -1e30], dtype=torch.float32)
        x_edges = typed((len(FLOAT_EDGES) + 9, 1), "float32", x_lo, x_hi, FLOAT_EDGES + (1.0, -1.0, 0.5, -0.5, 3e38))
        out = [((rand(*s, lo=x_lo, hi=x_hi), torch.randint(0, 12, s[-1:]).float()), {}) for s in SHAPES]
        out += [((rand(len(n_small), lo=x_lo, hi=x_hi), n_small), {}), ((x_edges, n_edges), {})]
        out += [((typed((4, 5), d, -3, 4), typed((5,), d, -2, 9, edges=False)), {}) for d in ALL_INT + ("bool",)]
        return out
    return samples


for _op, (_name, _body) in _POLY_BODIES.items():
    def _lower_polynomial(pb, node, x, n, _name=_name):
        return [elementwise(pb, node, [x, n], lambda k, a, b: f"{k.need(_name)}({a}, {b})", compute="f32", cost=32)]
    register(_op, F32_INT_BOOL, samples=_polynomial_samples(-4, 4) if "laguerre" not in _op else _polynomial_samples(-3, 12))(
        _lower_polynomial)
