// kernel fused_0 workgroups=[2, 1, 1] bindings=[('i0', 'read'), ('i1', 'read'), ('o2', 'read_write')]
@group(0) @binding(0) var<storage, read> buf_i0: array<i32>;
@group(0) @binding(1) var<storage, read> buf_i1: array<f32>;
@group(0) @binding(2) var<storage, read_write> buf_o2: array<f32>;

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n: i32 = i32(gid.y) * 128 + i32(gid.x);
  if (n >= 96) { return; }
  let t1: i32 = (n / 48);
  let t2: i32 = ((n / 16) % 3);
  let t3: i32 = (n % 16);
  let t4: i32 = buf_i0[t1 * 3 + t2];
  let t5: i32 = clamp(t4, 0, 9);
  let t6: f32 = buf_i1[t5 * 16 + t3];
  buf_o2[n] = t6;
}
