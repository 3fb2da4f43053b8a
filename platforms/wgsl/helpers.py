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
    "tap_log1p": (("tap_bits_f32",), """
fn tap_log1p(x: f32) -> f32 {
  let u = 1.0 + x;
  if (u < 0.0) { return tap_bits_f32(0x7fc00000u); }
  if (u == 0.0) { return tap_bits_f32(0xff800000u); }
  if (u == 1.0) { return x; }
  if (abs(x) > 0.5 || u == u + 1.0) { return log(u); }
  return log(u) * x / (u - 1.0);
}"""),
    "tap_expm1": ((), """
fn tap_expm1(x: f32) -> f32 {
  if (abs(x) < 1e-5) { return x + 0.5 * x * x; }
  return exp(x) - 1.0;
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
    "tap_pow": (("tap_bits_f32",), """
fn tap_pow(x: f32, y: f32) -> f32 {
  if (y == 0.0) { return 1.0; }
  if (x == 0.0) { return select(tap_bits_f32(0x7f800000u), 0.0, y > 0.0); }
  let p = exp2(y * log2(abs(x)));
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
    "tap_mod_f": ((), """
fn tap_mod_f(a: f32, b: f32) -> f32 {
  let r = a - b * trunc(a / b);
  return select(r, r + b, (r != 0.0) && ((r < 0.0) != (b < 0.0)));
}"""),
    "tap_fmod_f": ((), """
fn tap_fmod_f(a: f32, b: f32) -> f32 {
  return a - b * trunc(a / b);
}"""),
}
