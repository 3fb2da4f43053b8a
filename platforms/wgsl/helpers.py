"""WGSL helper functions kernels pull in by name: ``HELPERS[name] = (dependencies, source)``.

WGSL lacks erf, a NaN-propagating min/max, a pow defined for negative bases, floor
division and modulo with Python's sign rules; these supply them with torch's semantics.
"""

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
    # Some drivers compute tanh through exp and return NaN for large |x|.
    "tap_tanh": ((), """
fn tap_tanh(x: f32) -> f32 {
  if (x != x) { return x; }
  let a = abs(x);
  if (a < 0.0005) { return x; }
  if (a > 15.0) { return sign(x); }
  let e = exp(-2.0 * a);
  let y = (1.0 - e) / (1.0 + e);
  return select(y, -y, x < 0.0);
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
    # C's fmod: x for an infinite divisor (a - b * trunc(a / b) would be NaN), NaN for an infinite x.
    "tap_fmod_f": ((), """
fn tap_fmod_f(a: f32, b: f32) -> f32 {
  if (abs(b) > 3.4028234e38 && abs(a) <= 3.4028234e38) { return a; }
  return a - b * trunc(a / b);
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
    # log and log2 of a denormal read its mantissa bits: drivers' log treats denormals as the
    # smallest normal (lavapipe gave log(1e-40) = -88.0, not -92.1); WGSL leaves log of 0 and of a
    # negative number undefined (SwiftShader gave -88.0 and log|x|): -Inf and NaN as in torch
    "tap_log2": (("tap_bits_f32",), """
fn tap_log2(x: f32) -> f32 {
  if (x == 0.0) { return tap_bits_f32(0xff800000u); }
  if (x < 0.0) { return tap_bits_f32(0x7fc00000u); }
  if (x < 1.17549435e-38) { return log2(f32(bitcast<u32>(x) & 0x7fffffu)) - 149.0; }
  return log2(x);
}"""),
    "tap_log": (("tap_bits_f32",), """
fn tap_log(x: f32) -> f32 {
  if (x == 0.0) { return tap_bits_f32(0xff800000u); }
  if (x < 0.0) { return tap_bits_f32(0x7fc00000u); }
  if (x < 1.17549435e-38) { return log(f32(bitcast<u32>(x) & 0x7fffffu)) - 103.27892990343184; }
  return log(x);
}"""),
    # sin, cos, tan of an infinity are NaN (drivers return anything)
    "tap_sin": (("tap_bits_f32",), """
fn tap_sin(x: f32) -> f32 {
  if (abs(x) > 3.4028234e38) { return tap_bits_f32(0x7fc00000u); }
  return sin(x);
}"""),
    "tap_cos": (("tap_bits_f32",), """
fn tap_cos(x: f32) -> f32 {
  if (abs(x) > 3.4028234e38) { return tap_bits_f32(0x7fc00000u); }
  return cos(x);
}"""),
    "tap_tan": (("tap_bits_f32",), """
fn tap_tan(x: f32) -> f32 {
  if (abs(x) > 3.4028234e38) { return tap_bits_f32(0x7fc00000u); }
  return tan(x);
}"""),
    "tap_atan": (("tap_isnan",), """
fn tap_atan(x: f32) -> f32 {
  if (tap_isnan(x)) { return x; }
  return atan(x);
}"""),
}
