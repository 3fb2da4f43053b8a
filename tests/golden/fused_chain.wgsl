// kernel fused_0 workgroups=[1, 1, 1] bindings=[('i0', 'read'), ('i1', 'read'), ('o2', 'read_write')]
@group(0) @binding(0) var<storage, read> buf_i0: array<f32>;
@group(0) @binding(1) var<storage, read> buf_i1: array<f32>;
@group(0) @binding(2) var<storage, read_write> buf_o2: array<f32>;

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
  let t7: f32 = (0.5 * t6 * (1.0 + tap_erf(t6 * 0.7071067811865476)));
  buf_o2[n] = t7;
}
