// kernel softmax_0 workgroups=[1, 1, 1] bindings=[('i0', 'read'), ('t1', 'read_write')]
@group(0) @binding(0) var<storage, read> buf_i0: array<f32>;
@group(0) @binding(1) var<storage, read_write> buf_t1: array<f32>;

fn tap_bits_f32(u: u32) -> f32 {
  return bitcast<f32>(u);
}

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n: i32 = i32(gid.y) * 64 + i32(gid.x);
  if (n >= 4) { return; }
  var mx1: f32 = tap_bits_f32(0xff800000u);
  for (var j: i32 = 0; j < 16; j = j + 1) {
    let t2: f32 = buf_i0[n * 16 + j];
    mx1 = max(mx1, t2);
  }
  var sm3: f32 = 0.0;
  for (var j: i32 = 0; j < 16; j = j + 1) {
    let t4: f32 = buf_i0[n * 16 + j];
    sm3 = sm3 + exp(t4 - mx1);
  }
  for (var j: i32 = 0; j < 16; j = j + 1) {
    let t5: f32 = buf_i0[n * 16 + j];
    buf_t1[n * 16 + j] = (exp(t5 - mx1) / sm3);
  }
}
