// kernel addmm_0 workgroups=[1, 1, 1] bindings=[('i0', 'read'), ('i1', 'read'), ('i2', 'read'), ('t3', 'read_write')]
@group(0) @binding(0) var<storage, read> buf_i0_v4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> buf_i1_v4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> buf_i2: array<f32>;
@group(0) @binding(3) var<storage, read_write> buf_t3: array<f32>;

@compute @workgroup_size(8, 8, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let z: i32 = i32(gid.z);
  let m0: i32 = i32(gid.y) * 4;
  let n0: i32 = i32(gid.x) * 4;
  if (m0 >= 4 || n0 >= 8) { return; }
  let ra0: i32 = 0 + z * 0 + (m0 + 0) * 16;
  let ra1: i32 = 0 + z * 0 + (m0 + 1) * 16;
  let ra2: i32 = 0 + z * 0 + (m0 + 2) * 16;
  let ra3: i32 = 0 + z * 0 + (m0 + 3) * 16;
  let cb0: i32 = 0 + z * 0 + (n0 + 0) * 16;
  let cb1: i32 = 0 + z * 0 + (n0 + 1) * 16;
  let cb2: i32 = 0 + z * 0 + (n0 + 2) * 16;
  let cb3: i32 = 0 + z * 0 + (n0 + 3) * 16;
  var acc0_0: vec4<f32> = vec4<f32>(0.0);
  var acc1_0: vec4<f32> = vec4<f32>(0.0);
  var acc2_0: vec4<f32> = vec4<f32>(0.0);
  var acc3_0: vec4<f32> = vec4<f32>(0.0);
  for (var k: i32 = 0; k < 16; k = k + 4) {
      let a0 = buf_i0_v4[(ra0 + k) >> 2u];
      let a1 = buf_i0_v4[(ra1 + k) >> 2u];
      let a2 = buf_i0_v4[(ra2 + k) >> 2u];
      let a3 = buf_i0_v4[(ra3 + k) >> 2u];
      let b0 = buf_i1_v4[(cb0 + k) >> 2u];
      let b1 = buf_i1_v4[(cb1 + k) >> 2u];
      let b2 = buf_i1_v4[(cb2 + k) >> 2u];
      let b3 = buf_i1_v4[(cb3 + k) >> 2u];
      acc0_0 = acc0_0 + vec4<f32>(dot(a0, b0), dot(a0, b1), dot(a0, b2), dot(a0, b3));
      acc1_0 = acc1_0 + vec4<f32>(dot(a1, b0), dot(a1, b1), dot(a1, b2), dot(a1, b3));
      acc2_0 = acc2_0 + vec4<f32>(dot(a2, b0), dot(a2, b1), dot(a2, b2), dot(a2, b3));
      acc3_0 = acc3_0 + vec4<f32>(dot(a3, b0), dot(a3, b1), dot(a3, b2), dot(a3, b3));
  }
  let t1: i32 = m0 + 0;
  let t2: i32 = n0 + 0;
  if (t1 < 4 && t2 < 8) {
    let t3: f32 = buf_i2[t2];
    buf_t3[(z * 4 + t1) * 8 + t2] = (acc0_0.x + t3);
  }
  let t4: i32 = n0 + 1;
  if (t1 < 4 && t4 < 8) {
    let t5: f32 = buf_i2[t4];
    buf_t3[(z * 4 + t1) * 8 + t4] = (acc0_0.y + t5);
  }
  let t6: i32 = n0 + 2;
  if (t1 < 4 && t6 < 8) {
    let t7: f32 = buf_i2[t6];
    buf_t3[(z * 4 + t1) * 8 + t6] = (acc0_0.z + t7);
  }
  let t8: i32 = n0 + 3;
  if (t1 < 4 && t8 < 8) {
    let t9: f32 = buf_i2[t8];
    buf_t3[(z * 4 + t1) * 8 + t8] = (acc0_0.w + t9);
  }
  let t10: i32 = m0 + 1;
  if (t10 < 4 && t2 < 8) {
    let t11: f32 = buf_i2[t2];
    buf_t3[(z * 4 + t10) * 8 + t2] = (acc1_0.x + t11);
  }
  if (t10 < 4 && t4 < 8) {
    let t12: f32 = buf_i2[t4];
    buf_t3[(z * 4 + t10) * 8 + t4] = (acc1_0.y + t12);
  }
  if (t10 < 4 && t6 < 8) {
    let t13: f32 = buf_i2[t6];
    buf_t3[(z * 4 + t10) * 8 + t6] = (acc1_0.z + t13);
  }
  if (t10 < 4 && t8 < 8) {
    let t14: f32 = buf_i2[t8];
    buf_t3[(z * 4 + t10) * 8 + t8] = (acc1_0.w + t14);
  }
  let t15: i32 = m0 + 2;
  if (t15 < 4 && t2 < 8) {
    let t16: f32 = buf_i2[t2];
    buf_t3[(z * 4 + t15) * 8 + t2] = (acc2_0.x + t16);
  }
  if (t15 < 4 && t4 < 8) {
    let t17: f32 = buf_i2[t4];
    buf_t3[(z * 4 + t15) * 8 + t4] = (acc2_0.y + t17);
  }
  if (t15 < 4 && t6 < 8) {
    let t18: f32 = buf_i2[t6];
    buf_t3[(z * 4 + t15) * 8 + t6] = (acc2_0.z + t18);
  }
  if (t15 < 4 && t8 < 8) {
    let t19: f32 = buf_i2[t8];
    buf_t3[(z * 4 + t15) * 8 + t8] = (acc2_0.w + t19);
  }
  let t20: i32 = m0 + 3;
  if (t20 < 4 && t2 < 8) {
    let t21: f32 = buf_i2[t2];
    buf_t3[(z * 4 + t20) * 8 + t2] = (acc3_0.x + t21);
  }
  if (t20 < 4 && t4 < 8) {
    let t22: f32 = buf_i2[t4];
    buf_t3[(z * 4 + t20) * 8 + t4] = (acc3_0.y + t22);
  }
  if (t20 < 4 && t6 < 8) {
    let t23: f32 = buf_i2[t6];
    buf_t3[(z * 4 + t20) * 8 + t6] = (acc3_0.z + t23);
  }
  if (t20 < 4 && t8 < 8) {
    let t24: f32 = buf_i2[t8];
    buf_t3[(z * 4 + t20) * 8 + t8] = (acc3_0.w + t24);
  }
}
