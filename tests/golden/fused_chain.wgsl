// kernel fused_0 workgroups=[1, 1, 1] bindings=[('i0', 'read'), ('i1', 'read'), ('o2', 'read_write')]
@group(0) @binding(0) var<storage, read> buf_i0: array<f32>;
@group(0) @binding(1) var<storage, read> buf_i1: array<f32>;
@group(0) @binding(2) var<storage, read_write> buf_o2: array<f32>;

fn tap_erfcx_pos(a: f32) -> f32 {
  if (a > 1e10) { return 0.5641895835 / a; }
  let t = (a - 2.0) / (a + 2.0);
  return ((((((((((((((4.6739495473957504e-07 * t + -1.9130142391077243e-05) * t + -2.1888392438995652e-05) * t + 0.0001255138049600646) * t + 0.00022381386952474713) * t + -0.00043556716991588473) * t + -0.0014656001003459096) * t + 0.0012639800552278757) * t + 0.00872514396905899) * t + -0.008032540790736675) * t + -0.05422035604715347) * t + 0.1640511453151703) * t + -0.1660303771495819) * t + -0.09276382625102997) * t + 1.2769783735275269) / (1.0 + 2.0 * a);
}

fn tap_bits_f32(u: u32) -> f32 {
  return bitcast<f32>(u);
}

fn tap_isnan(x: f32) -> bool {
  return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn tap_exp_acc(x: f32) -> f32 {
  if (tap_isnan(x)) { return x; }
  if (x > 88.72284) { return tap_bits_f32(0x7f800000u); }
  if (x < -103.98) { return 0.0; }
  let n = round(x * 1.44269504);
  let r = (x - n * 0.693359375) + n * 2.12194440e-4;
  let k = i32(n);
  let k1 = k / 2;
  let s1 = bitcast<f32>(u32(k1 + 127) << 23u);
  let s2 = bitcast<f32>(u32(k - k1 + 127) << 23u);
  return exp(r) * s1 * s2;
}

fn tap_exp_mx2(x: f32) -> f32 {
  let a = abs(x);
  if (a > 11.0) { return 0.0; }
  let h = bitcast<f32>(bitcast<u32>(a) & 0xfffff000u);
  let l = a - h;
  return tap_exp_acc(-h * h) * tap_exp_acc(-l * (a + h));
}

fn tap_erf(x: f32) -> f32 {
  let a = abs(x);
  if (a < 0.5) {
    let x2 = x * x;
    return x * (1.1283791671 + x2 * (-0.3761263890 + x2 * (0.1128379167 + x2 * (-0.0268661706 + x2 * (0.0052239776 - x2 * 0.0008548327)))));
  }
  let t = 1.0 / (1.0 + 0.3275911 * a);
  let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * exp(-a * a);
  return select(y, -y, x < 0.0);
}

fn tap_erfc(x: f32) -> f32 {
  if (tap_isnan(x)) { return x; }
  if (abs(x) < 0.5) { return 1.0 - tap_erf(x); }
  let r = tap_erfcx_pos(abs(x)) * tap_exp_mx2(x);
  return select(r, 2.0 - r, x < 0.0);
}

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n: i32 = i32(gid.y) * 64 + i32(gid.x);
  if (n >= 64) { return; }
  let t1: i32 = (n / 16);
  let t2: i32 = (n % 16);
  let t3: f32 = buf_i0[t1 * 16 + t2];
  let t4: f32 = (t3 * f32(0.5));
  let t5: f32 = buf_i1[t2];
  let t6: f32 = (t4 + t5);
  let t7: f32 = (0.5 * t6 * tap_erfc(t6 * -0.7071067811865476));
  buf_o2[n] = t7;
}
