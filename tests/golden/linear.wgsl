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
  let ra0: i32 = 0 + z * 0 + min(m0 + 0, 3) * 16;
  let ra1: i32 = 0 + z * 0 + min(m0 + 1, 3) * 16;
  let ra2: i32 = 0 + z * 0 + min(m0 + 2, 3) * 16;
  let ra3: i32 = 0 + z * 0 + min(m0 + 3, 3) * 16;
  let cb0: i32 = 0 + z * 0 + min(n0 + 0, 7) * 16;
  let cb1: i32 = 0 + z * 0 + min(n0 + 1, 7) * 16;
  let cb2: i32 = 0 + z * 0 + min(n0 + 2, 7) * 16;
  let cb3: i32 = 0 + z * 0 + min(n0 + 3, 7) * 16;
  var acc0_0: vec4<f32> = vec4<f32>(0.0);
  var acc1_0: vec4<f32> = vec4<f32>(0.0);
  var acc2_0: vec4<f32> = vec4<f32>(0.0);
  var acc3_0: vec4<f32> = vec4<f32>(0.0);
  for (var k: i32 = 0; k < 16; k = k + 4) {
      let a0 = buf_i0_v4[(ra0 + k) / 4];
      let a1 = buf_i0_v4[(ra1 + k) / 4];
      let a2 = buf_i0_v4[(ra2 + k) / 4];
      let a3 = buf_i0_v4[(ra3 + k) / 4];
      let b0 = buf_i1_v4[(cb0 + k) / 4];
      let b1 = buf_i1_v4[(cb1 + k) / 4];
      let b2 = buf_i1_v4[(cb2 + k) / 4];
      let b3 = buf_i1_v4[(cb3 + k) / 4];
      acc0_0 = acc0_0 + vec4<f32>(dot(a0, b0), dot(a0, b1), dot(a0, b2), dot(a0, b3));
      acc1_0 = acc1_0 + vec4<f32>(dot(a1, b0), dot(a1, b1), dot(a1, b2), dot(a1, b3));
      acc2_0 = acc2_0 + vec4<f32>(dot(a2, b0), dot(a2, b1), dot(a2, b2), dot(a2, b3));
      acc3_0 = acc3_0 + vec4<f32>(dot(a3, b0), dot(a3, b1), dot(a3, b2), dot(a3, b3));
  }
  if (m0 + 0 < 4) {
    if (n0 + 0 < 8) {
      let t1: i32 = m0 + 0;
      let t2: i32 = n0 + 0;
      let t3: f32 = buf_i2[t2];
      buf_t3[(z * 4 + m0 + 0) * 8 + n0 + 0] = (acc0_0.x + t3);
    }
    if (n0 + 1 < 8) {
      let t4: i32 = m0 + 0;
      let t5: i32 = n0 + 1;
      let t6: f32 = buf_i2[t5];
      buf_t3[(z * 4 + m0 + 0) * 8 + n0 + 1] = (acc0_0.y + t6);
    }
    if (n0 + 2 < 8) {
      let t7: i32 = m0 + 0;
      let t8: i32 = n0 + 2;
      let t9: f32 = buf_i2[t8];
      buf_t3[(z * 4 + m0 + 0) * 8 + n0 + 2] = (acc0_0.z + t9);
    }
    if (n0 + 3 < 8) {
      let t10: i32 = m0 + 0;
      let t11: i32 = n0 + 3;
      let t12: f32 = buf_i2[t11];
      buf_t3[(z * 4 + m0 + 0) * 8 + n0 + 3] = (acc0_0.w + t12);
    }
  }
  if (m0 + 1 < 4) {
    if (n0 + 0 < 8) {
      let t13: i32 = m0 + 1;
      let t14: i32 = n0 + 0;
      let t15: f32 = buf_i2[t14];
      buf_t3[(z * 4 + m0 + 1) * 8 + n0 + 0] = (acc1_0.x + t15);
    }
    if (n0 + 1 < 8) {
      let t16: i32 = m0 + 1;
      let t17: i32 = n0 + 1;
      let t18: f32 = buf_i2[t17];
      buf_t3[(z * 4 + m0 + 1) * 8 + n0 + 1] = (acc1_0.y + t18);
    }
    if (n0 + 2 < 8) {
      let t19: i32 = m0 + 1;
      let t20: i32 = n0 + 2;
      let t21: f32 = buf_i2[t20];
      buf_t3[(z * 4 + m0 + 1) * 8 + n0 + 2] = (acc1_0.z + t21);
    }
    if (n0 + 3 < 8) {
      let t22: i32 = m0 + 1;
      let t23: i32 = n0 + 3;
      let t24: f32 = buf_i2[t23];
      buf_t3[(z * 4 + m0 + 1) * 8 + n0 + 3] = (acc1_0.w + t24);
    }
  }
  if (m0 + 2 < 4) {
    if (n0 + 0 < 8) {
      let t25: i32 = m0 + 2;
      let t26: i32 = n0 + 0;
      let t27: f32 = buf_i2[t26];
      buf_t3[(z * 4 + m0 + 2) * 8 + n0 + 0] = (acc2_0.x + t27);
    }
    if (n0 + 1 < 8) {
      let t28: i32 = m0 + 2;
      let t29: i32 = n0 + 1;
      let t30: f32 = buf_i2[t29];
      buf_t3[(z * 4 + m0 + 2) * 8 + n0 + 1] = (acc2_0.y + t30);
    }
    if (n0 + 2 < 8) {
      let t31: i32 = m0 + 2;
      let t32: i32 = n0 + 2;
      let t33: f32 = buf_i2[t32];
      buf_t3[(z * 4 + m0 + 2) * 8 + n0 + 2] = (acc2_0.z + t33);
    }
    if (n0 + 3 < 8) {
      let t34: i32 = m0 + 2;
      let t35: i32 = n0 + 3;
      let t36: f32 = buf_i2[t35];
      buf_t3[(z * 4 + m0 + 2) * 8 + n0 + 3] = (acc2_0.w + t36);
    }
  }
  if (m0 + 3 < 4) {
    if (n0 + 0 < 8) {
      let t37: i32 = m0 + 3;
      let t38: i32 = n0 + 0;
      let t39: f32 = buf_i2[t38];
      buf_t3[(z * 4 + m0 + 3) * 8 + n0 + 0] = (acc3_0.x + t39);
    }
    if (n0 + 1 < 8) {
      let t40: i32 = m0 + 3;
      let t41: i32 = n0 + 1;
      let t42: f32 = buf_i2[t41];
      buf_t3[(z * 4 + m0 + 3) * 8 + n0 + 1] = (acc3_0.y + t42);
    }
    if (n0 + 2 < 8) {
      let t43: i32 = m0 + 3;
      let t44: i32 = n0 + 2;
      let t45: f32 = buf_i2[t44];
      buf_t3[(z * 4 + m0 + 3) * 8 + n0 + 2] = (acc3_0.z + t45);
    }
    if (n0 + 3 < 8) {
      let t46: i32 = m0 + 3;
      let t47: i32 = n0 + 3;
      let t48: f32 = buf_i2[t47];
      buf_t3[(z * 4 + m0 + 3) * 8 + n0 + 3] = (acc3_0.w + t48);
    }
  }
}
