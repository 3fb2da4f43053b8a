"""WGSL helper functions kernels pull in by name: ``HELPERS[name] = (dependencies, source)``.

WGSL lacks erf, a NaN-propagating min/max, a pow defined for negative bases, floor
division and modulo with Python's sign rules; these supply them with torch's semantics.
"""

def horner(var: str, coeffs) -> str:
    """A WGSL Horner expression of the polynomial ``sum(c[i] * var**i)``."""
    e = repr(float(coeffs[-1]))
    for c in reversed(coeffs[:-1]):
        e = f"({e} * {var} + {float(c)!r})"
    return e


# (1 + 2x) erfcx(x) as a polynomial in t = (x - 2) / (x + 2), x in [0, inf)
_ERFCX = (1.2769783735275269, -0.09276382625102997, -0.1660303771495819, 0.1640511453151703, -0.05422035604715347,
          -0.008032540790736675, 0.00872514396905899, 0.0012639800552278757, -0.0014656001003459096,
          -0.00043556716991588473, 0.00022381386952474713, 0.0001255138049600646, -2.1888392438995652e-05,
          -1.9130142391077243e-05, 4.6739495473957504e-07)


HELPERS: dict[str, tuple[tuple[str, ...], str]] = {
    "tap_bits_f32": ((), """
fn tap_bits_f32(u: u32) -> f32 {
  return bitcast<f32>(u);
}"""),
    # f32 -> float16 bits with round-to-nearest-even, Inf on overflow and NaN kept: WGSL leaves
    # an out-of-range f32 -> f16 conversion indeterminate, and overflow is what float16 checks look for.
    "tap_f16_bits": ((), """
fn tap_f16_bits(x: f32) -> u32 {
  let b = bitcast<u32>(x);
  let sign = (b >> 16u) & 0x8000u;
  let a = b & 0x7fffffffu;
  if (a > 0x7f800000u) { return sign | 0x7e00u; }
  if (a >= 0x477ff000u) { return sign | 0x7c00u; }
  if (a >= 0x38800000u) {
    let m = a - 0x38000000u;
    return sign | ((m + 0xfffu + ((m >> 13u) & 1u)) >> 13u);
  }
  if (a < 0x33000000u) { return sign; }
  let shift = 126u - (a >> 23u);
  let mant = (a & 0x7fffffu) | 0x800000u;
  let q = mant >> shift;
  let rem = mant & ((1u << shift) - 1u);
  let half = 1u << (shift - 1u);
  return sign | (q + select(0u, 1u, rem > half || (rem == half && (q & 1u) == 1u)));
}"""),
    # f32 -> bfloat16 bits (the high half), round-to-nearest-even, NaN kept quiet.
    "tap_bf16_bits": ((), """
fn tap_bf16_bits(x: f32) -> u32 {
  let b = bitcast<u32>(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) { return (b >> 16u) | 0x40u; }
  return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}"""),
    "tap_round_f16": (("tap_f16_bits",), """
fn tap_round_f16(x: f32) -> f32 {
  return unpack2x16float(tap_f16_bits(x)).x;
}"""),
    # complex32: both parts rounded to float16 (nearest even), as one u32 word or as values
    "tap_c32_bits": (("tap_f16_bits",), """
fn tap_c32_bits(z: vec2<f32>) -> u32 {
  return tap_f16_bits(z.x) | (tap_f16_bits(z.y) << 16u);
}"""),
    "tap_round_c32": (("tap_c32_bits",), """
fn tap_round_c32(z: vec2<f32>) -> vec2<f32> {
  return unpack2x16float(tap_c32_bits(z));
}"""),
    "tap_round_bf16": (("tap_bf16_bits",), """
fn tap_round_bf16(x: f32) -> f32 {
  return bitcast<f32>(tap_bf16_bits(x) << 16u);
}"""),
    # Abramowitz & Stegun 7.1.26 has 1.5e-7 absolute error; good enough next to f32's 6e-8
    # for |x| >= 0.5; below that the Taylor series is exact to f32 precision.
    "tap_erf": ((), """
fn tap_erf(x: f32) -> f32 {
  let a = abs(x);
  if (a < 0.5) {
    let x2 = x * x;
    return x * (1.1283791671 + x2 * (-0.3761263890 + x2 * (0.1128379167 + x2 * (-0.0268661706 + x2 * (0.0052239776 - x2 * 0.0008548327)))));
  }
  let t = 1.0 / (1.0 + 0.3275911 * a);
  let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * exp(-a * a);
  return select(y, -y, x < 0.0);
}"""),
    # tanh = -t / (2 + t) with t = expm1(-2|x|): the drivers' tanh (and (1 - e) / (1 + e)) cancel for
    # small |x| and some return NaN for large |x|
    "tap_tanh": (("tap_expm1", "tap_isnan"), """
fn tap_tanh(x: f32) -> f32 {
  if (tap_isnan(x)) { return x; }
  let a = abs(x);
  if (a < 0.000244140625) { return x; }
  if (a > 9.5) { return sign(x); }
  let t = tap_expm1(-2.0 * a);
  let y = -t / (2.0 + t);
  return select(y, -y, x < 0.0);
}"""),
    # exp(a) / 2 for a >= 0 with the argument reduced to [-ln2/2, ln2/2] (the drivers' exp may be off
    # by 3 + 2|x| ulp) and the power of two applied in two halves, so that it overflows only where
    # exp(a) / 2 does (a > 89.4), not at exp(a)'s 88.7
    "tap_exp_half": (("tap_bits_f32",), """
fn tap_exp_half(a: f32) -> f32 {
  if (a > 89.5) { return tap_bits_f32(0x7f800000u); }
  let n = round(a * 1.4426950408889634);
  let r = (a - n * 0.693359375) + n * 2.12194440e-4;
  let k = i32(n) - 1;
  let k1 = k / 2;
  return exp(r) * bitcast<f32>(u32(k1 + 127) << 23u) * bitcast<f32>(u32(k - k1 + 127) << 23u);
}"""),
    # sinh and cosh through expm1 for |x| < 1 (the driver's sinh is garbage for tiny x)
    "tap_sinh": (("tap_expm1", "tap_exp_half", "tap_isnan"), """
fn tap_sinh(x: f32) -> f32 {
  if (tap_isnan(x)) { return x; }
  let a = abs(x);
  if (a < 0.000244140625) { return x; }
  var r: f32;
  if (a < 1.0) {
    let t = tap_expm1(a);
    r = 0.5 * (t + t / (t + 1.0));
  } else {
    let h = tap_exp_half(a);
    r = h - 0.25 / h;
  }
  return select(r, -r, x < 0.0);
}"""),
    "tap_cosh": (("tap_expm1", "tap_exp_half", "tap_isnan"), """
fn tap_cosh(x: f32) -> f32 {
  if (tap_isnan(x)) { return x; }
  let a = abs(x);
  if (a < 1.0) {
    let t = tap_expm1(a);
    return 1.0 + t * t / (2.0 * (t + 1.0));
  }
  let h = tap_exp_half(a);
  return h + 0.25 / h;
}"""),
    "tap_sigmoid": ((), """
fn tap_sigmoid(x: f32) -> f32 {
  if (x >= 0.0) { return 1.0 / (1.0 + exp(-x)); }
  let e = exp(x);
  return e / (1.0 + e);
}"""),
    # log1p and expm1 near 0 as series: the drivers' log and exp are accurate only in absolute
    # terms near 1 and 0, which is no relative accuracy for log(1 + x) or exp(x) - 1 of a small x
    "tap_log1p": (("tap_bits_f32",), """
fn tap_log1p(x: f32) -> f32 {
  if (abs(x) <= 0.5) {
    let s = x / (2.0 + x);
    let q = s * s;
    return 2.0 * s * (1.0 + q * (0.33333333 + q * (0.2 + q * (0.14285714 + q * (0.11111111 + q * (0.09090909
      + q * (0.07692308 + q * (0.06666667 + q * 0.05882353))))))));
  }
  let u = 1.0 + x;
  if (u < 0.0) { return tap_bits_f32(0x7fc00000u); }
  if (u == 0.0) { return tap_bits_f32(0xff800000u); }
  return log(u);
}"""),
    "tap_expm1": ((), """
fn tap_expm1(x: f32) -> f32 {
  if (abs(x) <= 0.5) {
    return x * (1.0 + x / 2.0 * (1.0 + x / 3.0 * (1.0 + x / 4.0 * (1.0 + x / 5.0 * (1.0 + x / 6.0 * (1.0 + x / 7.0
      * (1.0 + x / 8.0 * (1.0 + x / 9.0 * (1.0 + x / 10.0)))))))));
  }
  return exp(x) - 1.0;
}"""),
    "tap_asinh": (("tap_log1p",), """
fn tap_asinh(x: f32) -> f32 {
  let a = abs(x);
  var r: f32;
  if (a > 268435456.0) {
    r = log(a) + 0.6931471805599453;
  } else if (a < 0.000244140625) {
    return x;
  } else {
    r = tap_log1p(a + a * a / (1.0 + sqrt(1.0 + a * a)));
  }
  return select(r, -r, x < 0.0);
}"""),
    "tap_acosh": (("tap_log1p", "tap_bits_f32"), """
fn tap_acosh(x: f32) -> f32 {
  if (x < 1.0) { return tap_bits_f32(0x7fc00000u); }
  if (x > 268435456.0) { return log(x) + 0.6931471805599453; }
  let t = x - 1.0;
  return tap_log1p(t + sqrt(2.0 * t + t * t));
}"""),
    "tap_atanh": (("tap_log1p", "tap_bits_f32"), """
fn tap_atanh(x: f32) -> f32 {
  let a = abs(x);
  if (a > 1.0) { return tap_bits_f32(0x7fc00000u); }
  if (a < 0.000244140625) { return x; }
  let r = 0.5 * tap_log1p(2.0 * a / (1.0 - a));
  return select(r, -r, x < 0.0);
}"""),
    # WGSL leaves atan2 at zeros and infinities to the driver; these follow C's atan2 (and torch).
    "tap_atan2": (("tap_isnan",), """
fn tap_atan2(y: f32, x: f32) -> f32 {
  if (tap_isnan(y) || tap_isnan(x)) { return y + x; }
  let pi = 3.14159265358979;
  let y_neg = (bitcast<u32>(y) >> 31u) == 1u;
  let x_neg = (bitcast<u32>(x) >> 31u) == 1u;
  let yi = abs(y) > 3.4028234e38;
  let xi = abs(x) > 3.4028234e38;
  var r: f32;
  if (y == 0.0) {
    r = select(0.0, pi, x_neg);
  } else if (yi && xi) {
    r = select(0.25 * pi, 0.75 * pi, x_neg);
  } else if (yi || x == 0.0) {
    r = 0.5 * pi;
  } else if (xi) {
    r = select(0.0, pi, x_neg);
  } else {
    return atan2(y, x);
  }
  return select(r, -r, y_neg);
}"""),
    "tap_isnan": ((), """
fn tap_isnan(x: f32) -> bool {
  return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}"""),
    "tap_max": (("tap_isnan",), """
fn tap_max(a: f32, b: f32) -> f32 {
  if (tap_isnan(a) || tap_isnan(b)) { return a + b; }
  return max(a, b);
}"""),
    "tap_min": (("tap_isnan",), """
fn tap_min(a: f32, b: f32) -> f32 {
  if (tap_isnan(a) || tap_isnan(b)) { return a + b; }
  return min(a, b);
}"""),
    "tap_pow": (("tap_bits_f32", "tap_isnan", "tap_log2"), """
fn tap_pow(x: f32, y: f32) -> f32 {
  if (y == 0.0 || x == 1.0) { return 1.0; }
  if (tap_isnan(x) || tap_isnan(y)) { return x + y; }
  if (abs(x) > 3.4028234e38) {
    let odd_int = y == floor(y) && (y * 0.5) != floor(y * 0.5) && abs(y) < 16777216.0;
    let m = select(0.0, tap_bits_f32(0x7f800000u), y > 0.0);
    return select(m, -m, x < 0.0 && odd_int);
  }
  if (x == 0.0) {
    let odd_int = y == floor(y) && (y * 0.5) != floor(y * 0.5) && abs(y) < 16777216.0;
    let m = select(tap_bits_f32(0x7f800000u), 0.0, y > 0.0);
    return select(m, -m, odd_int && (bitcast<u32>(x) >> 31u) == 1u);
  }
  let p = exp2(y * tap_log2(abs(x)));
  if (x > 0.0) { return p; }
  if (y != floor(y)) { return tap_bits_f32(0x7fc00000u); }
  let odd = (y * 0.5) != floor(y * 0.5);
  return select(p, -p, odd);
}"""),
    "tap_ipow": ((), """
fn tap_ipow(x: i32, y: i32) -> i32 {
  if (y < 0) { return select(0, 1, x == 1) + select(0, select(1, -1, (y & 1) != 0), x == -1); }
  var r: i32 = 1;
  var b: i32 = x;
  var e: i32 = y;
  loop {
    if (e == 0) { break; }
    if ((e & 1) != 0) { r = r * b; }
    b = b * b;
    e = e >> 1u;
  }
  return r;
}"""),
    # GLSL leaves / and % undefined for negative operands (llvmpipe GL gets them wrong), so
    # integer division runs on magnitudes and the sign is applied after.
    "tap_div_i": ((), """
fn tap_div_i(a: i32, b: i32) -> i32 {
  if (b == 0) { return 0; }
  let q = i32(u32(abs(a)) / u32(abs(b)));
  return select(q, -q, (a < 0) != (b < 0));
}"""),
    "tap_rem_i": (("tap_div_i",), """
fn tap_rem_i(a: i32, b: i32) -> i32 {
  return a - tap_div_i(a, b) * b;
}"""),
    "tap_floordiv_i": (("tap_div_i",), """
fn tap_floordiv_i(a: i32, b: i32) -> i32 {
  let q = tap_div_i(a, b);
  return select(q, q - 1, (a - q * b != 0) && ((a < 0) != (b < 0)));
}"""),
    "tap_mod_i": (("tap_rem_i",), """
fn tap_mod_i(a: i32, b: i32) -> i32 {
  let r = tap_rem_i(a, b);
  return select(r, r + b, (r != 0) && ((r < 0) != (b < 0)));
}"""),
    "tap_mod_f": (("tap_fmod_f",), """
fn tap_mod_f(a: f32, b: f32) -> f32 {
  let r = tap_fmod_f(a, b);
  return select(r, r + b, (r != 0.0) && ((r < 0.0) != (b < 0.0)));
}"""),
    # C's fmod, exact (as C's is): the significands' long division, one bit per step of the
    # exponents' difference (a - b * trunc(a / b) loses everything once a / b passes 2**24);
    # a for an infinite divisor, NaN for an infinite a, a zero or a NaN divisor
    "tap_fmod_f": (("tap_bits_f32",), """
fn tap_fmod_f(a: f32, b: f32) -> f32 {
  let ua = bitcast<u32>(a) & 0x7fffffffu;
  let ub = bitcast<u32>(b) & 0x7fffffffu;
  if (ua > 0x7f800000u) { return a; }
  if (ua == 0x7f800000u || ub > 0x7f800000u || ub == 0u) { return tap_bits_f32(0x7fc00000u); }
  if (ub == 0x7f800000u || ua < ub) { return a; }
  var ea = i32(ua >> 23u);
  var eb = i32(ub >> 23u);
  var ma = ua & 0x7fffffu;
  var mb = ub & 0x7fffffu;
  if (ea == 0) { ea = 1; } else { ma = ma | 0x800000u; }
  if (eb == 0) { eb = 1; } else { mb = mb | 0x800000u; }
  for (var i: i32 = ea - eb; i > 0; i = i - 1) {
    if (ma >= mb) { ma = ma - mb; }
    ma = ma << 1u;
  }
  if (ma >= mb) { ma = ma - mb; }
  let sign = bitcast<u32>(a) & 0x80000000u;
  if (ma == 0u) { return bitcast<f32>(sign); }
  var e = eb;
  for (var i: i32 = 0; i < 24 && ma < 0x800000u && e > 1; i = i + 1) {
    ma = ma << 1u;
    e = e - 1;
  }
  if (ma < 0x800000u) { return bitcast<f32>(sign | ma); }
  return bitcast<f32>(sign | (u32(e) << 23u) | (ma & 0x7fffffu));
}"""),
    # torch's div_floor_floating: floor of (a - fmod(a, b)) / b, rounded to the nearer integer,
    # so that an infinite dividend gives NaN and a finite one over an infinite divisor 0 or -1.
    "tap_floordiv_f": (("tap_fmod_f",), """
fn tap_floordiv_f(a: f32, b: f32) -> f32 {
  if (b == 0.0) { return a / b; }
  let m = tap_fmod_f(a, b);
  var d = (a - m) / b;
  if (m != 0.0 && ((b < 0.0) != (m < 0.0))) { d = d - 1.0; }
  if (d == 0.0) { return select(0.0, bitcast<f32>(0x80000000u), (bitcast<u32>(a / b) >> 31u) == 1u); }
  var f = floor(d);
  if (d - f > 0.5) { f = f + 1.0; }
  return f;
}"""),
    # log and log2 of our own (FreeBSD's logf): x = 2^k m with m in [sqrt(1/2), sqrt(2)), and log(m) as a
    # polynomial in s = (m - 1) / (m + 1). The drivers' log is accurate only in absolute terms near 1
    # and treats denormals as the smallest normal (lavapipe gave log(1e-40) = -88.0, not -92.1), so a
    # denormal's mantissa bits are read as an integer. Returns (k, log(m)) for a finite x > 0.
    "tap_log_parts": ((), """
fn tap_log_parts(x: f32) -> vec2<f32> {
  var b = bitcast<u32>(x);
  var k = 0;
  if (b < 0x00800000u) {
    b = bitcast<u32>(f32(b));
    k = -149;
  }
  k = k + i32(b >> 23u) - 127;
  var m = bitcast<f32>((b & 0x7fffffu) | 0x3f800000u);
  if (m > 1.41421356) {
    m = 0.5 * m;
    k = k + 1;
  }
  let f = m - 1.0;
  let s = f / (2.0 + f);
  let z = s * s;
  let w = z * z;
  let r = w * (0.40000972152 + w * 0.24279078841) + z * (0.66666662693 + w * 0.28498786688);
  let hfsq = 0.5 * f * f;
  return vec2<f32>(f32(k), f - (hfsq - s * (hfsq + r)));
}"""),
    # WGSL leaves log of 0 and of a negative number undefined (SwiftShader gave -88.0 and log|x|):
    # -Inf and NaN as in torch
    "tap_log2": (("tap_bits_f32", "tap_log_parts"), """
fn tap_log2(x: f32) -> f32 {
  let b = bitcast<u32>(x);
  if ((b & 0x7fffffffu) == 0u) { return tap_bits_f32(0xff800000u); }
  if (b > 0x80000000u) { return tap_bits_f32(0x7fc00000u); }
  if (b >= 0x7f800000u) { return x; }
  let p = tap_log_parts(x);
  return p.x + p.y * 1.4426950408889634;
}"""),
    "tap_log": (("tap_bits_f32", "tap_log_parts"), """
fn tap_log(x: f32) -> f32 {
  let b = bitcast<u32>(x);
  if ((b & 0x7fffffffu) == 0u) { return tap_bits_f32(0xff800000u); }
  if (b > 0x80000000u) { return tap_bits_f32(0x7fc00000u); }
  if (b >= 0x7f800000u) { return x; }
  let p = tap_log_parts(x);
  return p.x * 0.693138122558593750 + (p.y + p.x * 9.05800061445916e-06);
}"""),
    # sin, cos, tan of an infinity are NaN (drivers return anything)
    # the full 64-bit product of two u32 (low word, high word), from 16-bit halves
    "tap_u32_mul_wide": ((), """
fn tap_u32_mul_wide(a: u32, b: u32) -> vec2<u32> {
  let a0 = a & 0xffffu; let a1 = a >> 16u; let b0 = b & 0xffffu; let b1 = b >> 16u;
  let p00 = a0 * b0; let p01 = a0 * b1; let p10 = a1 * b0; let p11 = a1 * b1;
  let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
  return vec2<u32>((p00 & 0xffffu) | (mid << 16u), p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u));
}"""),
    # x = r + q * pi/2 (|r| <= pi/4, q mod 4) for |x| >= 8192, by Payne and Hanek: x's 24-bit
    # significand times four 32-bit words of 2/pi (the words whose products are not multiples of 4),
    # exact in integers; 64 bits of that product past the binary point give q and r
    "tap_rem_pio2_large": (("tap_u32_mul_wide",), """
fn tap_rem_pio2_large(x: f32) -> vec2<f32> {
  var two_over_pi = array<u32, 7>(0xa2f9836eu, 0x4e441529u, 0xfc2757d1u, 0xf534ddc0u, 0xdb629599u, 0x3c439041u,
                                  0xfe5163abu);
  let bits = bitcast<u32>(x);
  let m = (bits & 0x7fffffu) | 0x800000u;
  let e = i32((bits >> 23u) & 0xffu) - 150;
  let j0 = max(0, (e - 2) >> 5u);
  let a0 = tap_u32_mul_wide(m, two_over_pi[j0]);
  let a1 = tap_u32_mul_wide(m, two_over_pi[j0 + 1]);
  let a2 = tap_u32_mul_wide(m, two_over_pi[j0 + 2]);
  let a3 = tap_u32_mul_wide(m, two_over_pi[j0 + 3]);
  var p = array<u32, 6>(a3.x, 0u, 0u, 0u, 0u, 0u);
  var carry = 0u;
  let s1 = a3.y + a2.x; p[1] = s1; carry = select(0u, 1u, s1 < a3.y);
  let s2 = a2.y + a1.x; let s2c = s2 + carry; p[2] = s2c;
  carry = select(0u, 1u, s2 < a2.y) + select(0u, 1u, s2c < s2);
  let s3 = a1.y + a0.x; let s3c = s3 + carry; p[3] = s3c;
  carry = select(0u, 1u, s3 < a1.y) + select(0u, 1u, s3c < s3);
  p[4] = a0.y + carry;
  // the product times 2**(e - 32 (j0 + 4)): its binary point is t bits up; take bits t+1 .. t-62
  let sh = u32(32 * (j0 + 4) - e - 62);
  let wi = sh >> 5u;
  let b = sh & 31u;
  var lo = p[wi];
  var hi = p[wi + 1u];
  if (b != 0u) {
    lo = (lo >> b) | (hi << (32u - b));
    hi = (hi >> b) | (p[wi + 2u] << (32u - b));
  }
  var q = hi >> 30u;
  var fhi = hi & 0x3fffffffu;
  var flo = lo;
  var sign = 1.0;
  if ((fhi & 0x20000000u) != 0u) {  // a fraction past 1/2: one more quadrant, the fraction minus 1
    q = q + 1u;
    fhi = 0x40000000u - fhi - select(0u, 1u, flo != 0u);
    flo = 0u - flo;
    sign = -1.0;
  }
  var r = sign * (f32(fhi) * 9.313225746154785e-10 + f32(flo) * 2.168404344971009e-19) * 1.5707963267948966;
  if ((bits >> 31u) == 1u) {
    r = -r;
    q = 4u - q;
  }
  return vec2<f32>(r, f32(q & 3u));
}"""),
    # (sin x, cos x) of our own (Cephes' sinf and cosf after a three-part Cody-Waite reduction by
    # pi/2, good to a few ulp for |x| < 8192; Payne-Hanek past that): WGSL lets sin and cos be off
    # by 2**-11 absolute (Chromium's are), and drivers reduce large arguments poorly or not at all
    "tap_sincos": (("tap_bits_f32", "tap_rem_pio2_large"), """
fn tap_sincos(x: f32) -> vec2<f32> {
  if (!(abs(x) <= 3.4028234e38)) { return vec2<f32>(tap_bits_f32(0x7fc00000u)); }
  var r: f32;
  var q: i32;
  if (abs(x) < 8192.0) {
    let j = round(x * 0.636619772367581343);
    r = ((x - j * 1.5703125) - j * 4.837512969970703125e-4) - j * 7.549789948768648e-8;
    q = i32(j - 4.0 * floor(j * 0.25));
  } else {
    let rq = tap_rem_pio2_large(x);
    r = rq.x;
    q = i32(rq.y);
  }
  let z = r * r;
  let s = r + r * z * ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1);
  let c = 1.0 - 0.5 * z + z * z * ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2);
  if (q == 0) { return vec2<f32>(s, c); }
  if (q == 1) { return vec2<f32>(c, -s); }
  if (q == 2) { return vec2<f32>(-s, -c); }
  return vec2<f32>(-c, s);
}"""),
    "tap_sin": (("tap_sincos",), """
fn tap_sin(x: f32) -> f32 {
  return tap_sincos(x).x;
}"""),
    "tap_cos": (("tap_sincos",), """
fn tap_cos(x: f32) -> f32 {
  return tap_sincos(x).y;
}"""),
    "tap_tan": (("tap_sincos",), """
fn tap_tan(x: f32) -> f32 {
  let sc = tap_sincos(x);
  return sc.x / sc.y;
}"""),
    # atan, asin, acos of our own (Cephes' atanf, asinf): WGSL allows the drivers' 4096 ulp. pi/2 and
    # pi are each an f32 plus a correction, so that results near them lose nothing to the constant.
    "tap_atan": (("tap_isnan",), """
fn tap_atan(x: f32) -> f32 {
  if (tap_isnan(x)) { return x; }
  let a = abs(x);
  if (a < 0.000244140625) { return x; }
  var hi = 0.0;
  var lo = 0.0;
  var t = a;
  if (a > 2.414213562373095) {
    hi = 1.5707963705062866;
    lo = -4.371139006309477e-08;
    t = -1.0 / a;
  } else if (a > 0.41421356237309503) {
    hi = 0.7853981852531433;
    lo = -2.1855695031547384e-08;
    t = (a - 1.0) / (a + 1.0);
  }
  let z = t * t;
  let r = hi + ((((0.0805374449538 * z - 0.138776856032) * z + 0.199777106478) * z - 0.333329491539) * z * t + t + lo);
  return select(r, -r, x < 0.0);
}"""),
    # asin(x) for |x| <= 0.5
    "tap_asin_small": ((), """
fn tap_asin_small(x: f32) -> f32 {
  let z = x * x;
  return x + x * z * ((((0.042163199048 * z + 0.024181311049) * z + 0.045470025998) * z + 0.074953002686) * z
    + 0.16666752422);
}"""),
    # |x| > 0.5 through the half angle: asin(a) = pi/2 - 2 asin(sqrt((1 - a) / 2))
    "tap_asin": (("tap_asin_small", "tap_isnan", "tap_bits_f32"), """
fn tap_asin(x: f32) -> f32 {
  if (tap_isnan(x)) { return x; }
  let a = abs(x);
  if (a > 1.0) { return tap_bits_f32(0x7fc00000u); }
  if (a < 0.000244140625) { return x; }
  if (a <= 0.5) { return tap_asin_small(x); }
  let r = 1.5707963705062866 - (2.0 * tap_asin_small(sqrt(0.5 * (1.0 - a))) + 4.371139006309477e-08);
  return select(r, -r, x < 0.0);
}"""),
    "tap_acos": (("tap_asin_small", "tap_isnan", "tap_bits_f32"), """
fn tap_acos(x: f32) -> f32 {
  if (tap_isnan(x)) { return x; }
  if (abs(x) > 1.0) { return tap_bits_f32(0x7fc00000u); }
  if (x > 0.5) { return 2.0 * tap_asin_small(sqrt(0.5 * (1.0 - x))); }
  if (x < -0.5) { return 3.1415927410125732 - (2.0 * tap_asin_small(sqrt(0.5 * (1.0 + x))) + 8.742278012618954e-08); }
  return 1.5707963705062866 - (tap_asin_small(x) + 4.371139006309477e-08);
}"""),
    # exp with Cody-Waite reduction: the driver's exp loses |x|·2^-24 of relative accuracy for large |x|
    "tap_exp_acc": (("tap_bits_f32", "tap_isnan"), f"""
fn tap_exp_acc(x: f32) -> f32 {{
  if (tap_isnan(x)) {{ return x; }}
  if (x > 88.72284) {{ return tap_bits_f32(0x7f800000u); }}
  if (x < -103.98) {{ return 0.0; }}
  let n = round(x * 1.44269504);
  let r = (x - n * 0.693359375) + n * 2.12194440e-4;
  let k = i32(n);
  let k1 = k / 2;
  let s1 = bitcast<f32>(u32(k1 + 127) << 23u);
  let s2 = bitcast<f32>(u32(k - k1 + 127) << 23u);
  return exp(r) * s1 * s2;
}}"""),
    # exp(-x²) with x split into 12 high bits (whose square is exact) and the rest
    "tap_exp_mx2": (("tap_exp_acc",), """
fn tap_exp_mx2(x: f32) -> f32 {
  let a = abs(x);
  if (a > 11.0) { return 0.0; }
  let h = bitcast<f32>(bitcast<u32>(a) & 0xfffff000u);
  let l = a - h;
  return tap_exp_acc(-h * h) * tap_exp_acc(-l * (a + h));
}"""),
    # erfcx for a >= 0 (a = +inf gives 0)
    "tap_erfcx_pos": ((), f"""
fn tap_erfcx_pos(a: f32) -> f32 {{
  if (a > 1e10) {{ return 0.5641895835 / a; }}
  let t = (a - 2.0) / (a + 2.0);
  return {horner("t", _ERFCX)} / (1.0 + 2.0 * a);
}}"""),
    "tap_erfc": (("tap_erfcx_pos", "tap_exp_mx2", "tap_erf", "tap_isnan"), """
fn tap_erfc(x: f32) -> f32 {
  if (tap_isnan(x)) { return x; }
  if (abs(x) < 0.5) { return 1.0 - tap_erf(x); }
  let r = tap_erfcx_pos(abs(x)) * tap_exp_mx2(x);
  return select(r, 2.0 - r, x < 0.0);
}"""),
    # a * b of two u32 as 64 bits (lo, hi), from 16-bit halves
    "tap_mul_u64": ((), """
fn tap_mul_u64(x: u32, y: u32) -> vec2<u32> {
  let ll = (x & 0xffffu) * (y & 0xffffu);
  let lh = (x & 0xffffu) * (y >> 16u);
  let hl = (x >> 16u) * (y & 0xffffu);
  let mid = (ll >> 16u) + (lh & 0xffffu) + (hl & 0xffffu);
  return vec2<u32>((ll & 0xffffu) | (mid << 16u), (x >> 16u) * (y >> 16u) + (lh >> 16u) + (hl >> 16u) + (mid >> 16u));
}"""),
    # the sign of a * 2^d - m * b, exactly (a < 2^24, 0 <= d <= 40, m < 2^26, b < 2^24)
    "tap_cmp_scaled": (("tap_mul_u64",), """
fn tap_cmp_scaled(a: u32, d: i32, m: u32, b: u32) -> i32 {
  let p = tap_mul_u64(m, b);
  var lo: u32 = a;
  var hi: u32 = 0u;
  if (d >= 32) { lo = 0u; hi = a << u32(d - 32); } else if (d > 0) { lo = a << u32(d); hi = a >> u32(32 - d); }
  if (hi != p.y) { return select(-1, 1, hi > p.y); }
  if (lo != p.x) { return select(-1, 1, lo > p.x); }
  return 0;
}"""),
    # r (a quotient a / b a few ULP off, as WGSL allows division to be) moved to a / b rounded to nearest
    # even, by comparing a with b times the midpoints next to r in integers; a >= 0, b > 0, both normal, r
    # normal (anything else comes back as it is)
    "tap_div_fix": (("tap_cmp_scaled",), """
fn tap_div_fix(a: f32, b: f32, approx: f32) -> f32 {
  var r = approx;
  let ab = bitcast<u32>(a);
  let bb = bitcast<u32>(b);
  if ((ab >> 23u) == 0u || (ab >> 23u) >= 255u || (bb >> 23u) == 0u || (bb >> 23u) >= 255u) { return r; }
  let am = (ab & 0x7fffffu) | 0x800000u;
  let bm = (bb & 0x7fffffu) | 0x800000u;
  for (var i: i32 = 0; i < 4; i = i + 1) {
    let rb = bitcast<u32>(r);
    if ((rb >> 23u) == 0u || (rb >> 23u) >= 254u) { return r; }
    let rm = (rb & 0x7fffffu) | 0x800000u;
    let d = i32(ab >> 23u) - i32(rb >> 23u) - i32(bb >> 23u) + 151;
    if (d < 1 || d > 39) { return r; }
    let up = tap_cmp_scaled(am, d, 2u * rm + 1u, bm);
    if (up > 0 || (up == 0 && (rm & 1u) == 1u)) { r = bitcast<f32>(rb + 1u); continue; }
    var down: i32;
    if (rm == 0x800000u) { down = tap_cmp_scaled(am, d + 1, 4u * rm - 1u, bm); }
    else { down = tap_cmp_scaled(am, d, 2u * rm - 1u, bm); }
    if (down < 0 || (down == 0 && (rm & 1u) == 1u)) { r = bitcast<f32>(rb - 1u); continue; }
    break;
  }
  return r;
}"""),
    "tap_div_rn": (("tap_div_fix",), """
fn tap_div_rn(a: f32, b: f32) -> f32 {
  return tap_div_fix(a, b, a / b);
}"""),
}
