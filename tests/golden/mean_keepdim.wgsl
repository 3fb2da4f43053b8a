// kernel mean_0 workgroups=[1, 1, 1] bindings=[('i0', 'read'), ('t1', 'read_write')]
@group(0) @binding(0) var<storage, read> buf_i0: array<f32>;
@group(0) @binding(1) var<storage, read_write> buf_t1: array<f32>;

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n: i32 = i32(gid.y) * 64 + i32(gid.x);
  if (n >= 4) { return; }
  var acc1: f32 = f32(0.0);
  for (var r: i32 = 0; r < 16; r = r + 1) {
    let t2: f32 = buf_i0[n * 16 + r];
    acc1 = (acc1 + t2);
  }
  buf_t1[n] = (acc1 / f32(16.0));
}
