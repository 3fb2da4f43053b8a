// kernel addmm_gemv_0 workgroups=[1, 1, 1] bindings=[('i0', 'read'), ('i1', 'read'), ('i2', 'read'), ('t3', 'read_write')]
@group(0) @binding(0) var<storage, read> buf_i0_v4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> buf_i1_v4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> buf_i2: array<f32>;
@group(0) @binding(3) var<storage, read_write> buf_t3: array<f32>;
var<workgroup> partial: array<f32, 1024>;

@compute @workgroup_size(8, 8, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
  let lane: i32 = i32(lid.x);
  let z: i32 = i32(wid.z);
let mb: i32 = 0;
  let m0: i32 = min(mb + 0, 3);
  let ra0: i32 = 0 + z * 0 + m0 * 16;
  let m1: i32 = min(mb + 1, 3);
  let ra1: i32 = 0 + z * 0 + m1 * 16;
  let m2: i32 = min(mb + 2, 3);
  let ra2: i32 = 0 + z * 0 + m2 * 16;
  let m3: i32 = min(mb + 3, 3);
  let ra3: i32 = 0 + z * 0 + m3 * 16;
  let block: i32 = i32(wid.y) * 1 + i32(wid.x);
  var acc0_0: vec4<f32> = vec4<f32>(0.0);
  var acc0_1: vec4<f32> = vec4<f32>(0.0);
  var acc0_2: vec4<f32> = vec4<f32>(0.0);
  var acc0_3: vec4<f32> = vec4<f32>(0.0);
  var acc1_0: vec4<f32> = vec4<f32>(0.0);
  var acc1_1: vec4<f32> = vec4<f32>(0.0);
  var acc1_2: vec4<f32> = vec4<f32>(0.0);
  var acc1_3: vec4<f32> = vec4<f32>(0.0);
  var acc2_0: vec4<f32> = vec4<f32>(0.0);
  var acc2_1: vec4<f32> = vec4<f32>(0.0);
  var acc2_2: vec4<f32> = vec4<f32>(0.0);
  var acc2_3: vec4<f32> = vec4<f32>(0.0);
  var acc3_0: vec4<f32> = vec4<f32>(0.0);
  var acc3_1: vec4<f32> = vec4<f32>(0.0);
  var acc3_2: vec4<f32> = vec4<f32>(0.0);
  var acc3_3: vec4<f32> = vec4<f32>(0.0);
  var n0: i32 = 0;
  n0 = ((block - 0) * 8 + i32(lid.y)) * 4;
  let t1: i32 = 0 + z * 0 + min(n0 + 0, 7) * 16;
  let t2: i32 = 0 + z * 0 + min(n0 + 1, 7) * 16;
  let t3: i32 = 0 + z * 0 + min(n0 + 2, 7) * 16;
  let t4: i32 = 0 + z * 0 + min(n0 + 3, 7) * 16;
  for (var i: i32 = 0; i < 1; i = i + 1) {
    let t5: i32 = (lane + i * 8) * 4;
    if (t5 < 16) {
      let t6: vec4<f32> = buf_i0_v4[(ra0 + t5) / 4];
      let t7: vec4<f32> = buf_i0_v4[(ra1 + t5) / 4];
      let t8: vec4<f32> = buf_i0_v4[(ra2 + t5) / 4];
      let t9: vec4<f32> = buf_i0_v4[(ra3 + t5) / 4];
      let t10: vec4<f32> = buf_i1_v4[(t1 + t5) / 4];
      acc0_0 = acc0_0 + t6 * t10;
      acc1_0 = acc1_0 + t7 * t10;
      acc2_0 = acc2_0 + t8 * t10;
      acc3_0 = acc3_0 + t9 * t10;
      let t11: vec4<f32> = buf_i1_v4[(t2 + t5) / 4];
      acc0_1 = acc0_1 + t6 * t11;
      acc1_1 = acc1_1 + t7 * t11;
      acc2_1 = acc2_1 + t8 * t11;
      acc3_1 = acc3_1 + t9 * t11;
      let t12: vec4<f32> = buf_i1_v4[(t3 + t5) / 4];
      acc0_2 = acc0_2 + t6 * t12;
      acc1_2 = acc1_2 + t7 * t12;
      acc2_2 = acc2_2 + t8 * t12;
      acc3_2 = acc3_2 + t9 * t12;
      let t13: vec4<f32> = buf_i1_v4[(t4 + t5) / 4];
      acc0_3 = acc0_3 + t6 * t13;
      acc1_3 = acc1_3 + t7 * t13;
      acc2_3 = acc2_3 + t8 * t13;
      acc3_3 = acc3_3 + t9 * t13;
    }
  }
  let t14: i32 = (i32(lid.y) * 8 + lane) * 16;
  partial[t14 + 0] = (acc0_0.x + acc0_0.y + acc0_0.z + acc0_0.w);
  partial[t14 + 1] = (acc0_1.x + acc0_1.y + acc0_1.z + acc0_1.w);
  partial[t14 + 2] = (acc0_2.x + acc0_2.y + acc0_2.z + acc0_2.w);
  partial[t14 + 3] = (acc0_3.x + acc0_3.y + acc0_3.z + acc0_3.w);
  partial[t14 + 4] = (acc1_0.x + acc1_0.y + acc1_0.z + acc1_0.w);
  partial[t14 + 5] = (acc1_1.x + acc1_1.y + acc1_1.z + acc1_1.w);
  partial[t14 + 6] = (acc1_2.x + acc1_2.y + acc1_2.z + acc1_2.w);
  partial[t14 + 7] = (acc1_3.x + acc1_3.y + acc1_3.z + acc1_3.w);
  partial[t14 + 8] = (acc2_0.x + acc2_0.y + acc2_0.z + acc2_0.w);
  partial[t14 + 9] = (acc2_1.x + acc2_1.y + acc2_1.z + acc2_1.w);
  partial[t14 + 10] = (acc2_2.x + acc2_2.y + acc2_2.z + acc2_2.w);
  partial[t14 + 11] = (acc2_3.x + acc2_3.y + acc2_3.z + acc2_3.w);
  partial[t14 + 12] = (acc3_0.x + acc3_0.y + acc3_0.z + acc3_0.w);
  partial[t14 + 13] = (acc3_1.x + acc3_1.y + acc3_1.z + acc3_1.w);
  partial[t14 + 14] = (acc3_2.x + acc3_2.y + acc3_2.z + acc3_2.w);
  partial[t14 + 15] = (acc3_3.x + acc3_3.y + acc3_3.z + acc3_3.w);
  workgroupBarrier();
  if (lane < 4) {
    partial[t14 + 0] = partial[t14 + 0] + partial[t14 + 64];
    partial[t14 + 1] = partial[t14 + 1] + partial[t14 + 65];
    partial[t14 + 2] = partial[t14 + 2] + partial[t14 + 66];
    partial[t14 + 3] = partial[t14 + 3] + partial[t14 + 67];
    partial[t14 + 4] = partial[t14 + 4] + partial[t14 + 68];
    partial[t14 + 5] = partial[t14 + 5] + partial[t14 + 69];
    partial[t14 + 6] = partial[t14 + 6] + partial[t14 + 70];
    partial[t14 + 7] = partial[t14 + 7] + partial[t14 + 71];
    partial[t14 + 8] = partial[t14 + 8] + partial[t14 + 72];
    partial[t14 + 9] = partial[t14 + 9] + partial[t14 + 73];
    partial[t14 + 10] = partial[t14 + 10] + partial[t14 + 74];
    partial[t14 + 11] = partial[t14 + 11] + partial[t14 + 75];
    partial[t14 + 12] = partial[t14 + 12] + partial[t14 + 76];
    partial[t14 + 13] = partial[t14 + 13] + partial[t14 + 77];
    partial[t14 + 14] = partial[t14 + 14] + partial[t14 + 78];
    partial[t14 + 15] = partial[t14 + 15] + partial[t14 + 79];
  }
  workgroupBarrier();
  if (lane < 2) {
    partial[t14 + 0] = partial[t14 + 0] + partial[t14 + 32];
    partial[t14 + 1] = partial[t14 + 1] + partial[t14 + 33];
    partial[t14 + 2] = partial[t14 + 2] + partial[t14 + 34];
    partial[t14 + 3] = partial[t14 + 3] + partial[t14 + 35];
    partial[t14 + 4] = partial[t14 + 4] + partial[t14 + 36];
    partial[t14 + 5] = partial[t14 + 5] + partial[t14 + 37];
    partial[t14 + 6] = partial[t14 + 6] + partial[t14 + 38];
    partial[t14 + 7] = partial[t14 + 7] + partial[t14 + 39];
    partial[t14 + 8] = partial[t14 + 8] + partial[t14 + 40];
    partial[t14 + 9] = partial[t14 + 9] + partial[t14 + 41];
    partial[t14 + 10] = partial[t14 + 10] + partial[t14 + 42];
    partial[t14 + 11] = partial[t14 + 11] + partial[t14 + 43];
    partial[t14 + 12] = partial[t14 + 12] + partial[t14 + 44];
    partial[t14 + 13] = partial[t14 + 13] + partial[t14 + 45];
    partial[t14 + 14] = partial[t14 + 14] + partial[t14 + 46];
    partial[t14 + 15] = partial[t14 + 15] + partial[t14 + 47];
  }
  workgroupBarrier();
  if (lane < 1) {
    partial[t14 + 0] = partial[t14 + 0] + partial[t14 + 16];
    partial[t14 + 1] = partial[t14 + 1] + partial[t14 + 17];
    partial[t14 + 2] = partial[t14 + 2] + partial[t14 + 18];
    partial[t14 + 3] = partial[t14 + 3] + partial[t14 + 19];
    partial[t14 + 4] = partial[t14 + 4] + partial[t14 + 20];
    partial[t14 + 5] = partial[t14 + 5] + partial[t14 + 21];
    partial[t14 + 6] = partial[t14 + 6] + partial[t14 + 22];
    partial[t14 + 7] = partial[t14 + 7] + partial[t14 + 23];
    partial[t14 + 8] = partial[t14 + 8] + partial[t14 + 24];
    partial[t14 + 9] = partial[t14 + 9] + partial[t14 + 25];
    partial[t14 + 10] = partial[t14 + 10] + partial[t14 + 26];
    partial[t14 + 11] = partial[t14 + 11] + partial[t14 + 27];
    partial[t14 + 12] = partial[t14 + 12] + partial[t14 + 28];
    partial[t14 + 13] = partial[t14 + 13] + partial[t14 + 29];
    partial[t14 + 14] = partial[t14 + 14] + partial[t14 + 30];
    partial[t14 + 15] = partial[t14 + 15] + partial[t14 + 31];
  }
  workgroupBarrier();
  if (lane == 0 && block >= 0 && block < 1) {
    if (n0 + 0 < 8) {
      let t15: i32 = n0 + 0;
      let t16: f32 = buf_i2[t15];
      buf_t3[(z * 4 + m0) * 8 + n0 + 0] = (partial[t14 + 0] + t16);
    }
    if (n0 + 1 < 8) {
      let t17: i32 = n0 + 1;
      let t18: f32 = buf_i2[t17];
      buf_t3[(z * 4 + m0) * 8 + n0 + 1] = (partial[t14 + 1] + t18);
    }
    if (n0 + 2 < 8) {
      let t19: i32 = n0 + 2;
      let t20: f32 = buf_i2[t19];
      buf_t3[(z * 4 + m0) * 8 + n0 + 2] = (partial[t14 + 2] + t20);
    }
    if (n0 + 3 < 8) {
      let t21: i32 = n0 + 3;
      let t22: f32 = buf_i2[t21];
      buf_t3[(z * 4 + m0) * 8 + n0 + 3] = (partial[t14 + 3] + t22);
    }
    if (n0 + 0 < 8) {
      let t23: i32 = n0 + 0;
      let t24: f32 = buf_i2[t23];
      buf_t3[(z * 4 + m1) * 8 + n0 + 0] = (partial[t14 + 4] + t24);
    }
    if (n0 + 1 < 8) {
      let t25: i32 = n0 + 1;
      let t26: f32 = buf_i2[t25];
      buf_t3[(z * 4 + m1) * 8 + n0 + 1] = (partial[t14 + 5] + t26);
    }
    if (n0 + 2 < 8) {
      let t27: i32 = n0 + 2;
      let t28: f32 = buf_i2[t27];
      buf_t3[(z * 4 + m1) * 8 + n0 + 2] = (partial[t14 + 6] + t28);
    }
    if (n0 + 3 < 8) {
      let t29: i32 = n0 + 3;
      let t30: f32 = buf_i2[t29];
      buf_t3[(z * 4 + m1) * 8 + n0 + 3] = (partial[t14 + 7] + t30);
    }
    if (n0 + 0 < 8) {
      let t31: i32 = n0 + 0;
      let t32: f32 = buf_i2[t31];
      buf_t3[(z * 4 + m2) * 8 + n0 + 0] = (partial[t14 + 8] + t32);
    }
    if (n0 + 1 < 8) {
      let t33: i32 = n0 + 1;
      let t34: f32 = buf_i2[t33];
      buf_t3[(z * 4 + m2) * 8 + n0 + 1] = (partial[t14 + 9] + t34);
    }
    if (n0 + 2 < 8) {
      let t35: i32 = n0 + 2;
      let t36: f32 = buf_i2[t35];
      buf_t3[(z * 4 + m2) * 8 + n0 + 2] = (partial[t14 + 10] + t36);
    }
    if (n0 + 3 < 8) {
      let t37: i32 = n0 + 3;
      let t38: f32 = buf_i2[t37];
      buf_t3[(z * 4 + m2) * 8 + n0 + 3] = (partial[t14 + 11] + t38);
    }
    if (n0 + 0 < 8) {
      let t39: i32 = n0 + 0;
      let t40: f32 = buf_i2[t39];
      buf_t3[(z * 4 + m3) * 8 + n0 + 0] = (partial[t14 + 12] + t40);
    }
    if (n0 + 1 < 8) {
      let t41: i32 = n0 + 1;
      let t42: f32 = buf_i2[t41];
      buf_t3[(z * 4 + m3) * 8 + n0 + 1] = (partial[t14 + 13] + t42);
    }
    if (n0 + 2 < 8) {
      let t43: i32 = n0 + 2;
      let t44: f32 = buf_i2[t43];
      buf_t3[(z * 4 + m3) * 8 + n0 + 2] = (partial[t14 + 14] + t44);
    }
    if (n0 + 3 < 8) {
      let t45: i32 = n0 + 3;
      let t46: f32 = buf_i2[t45];
      buf_t3[(z * 4 + m3) * 8 + n0 + 3] = (partial[t14 + 15] + t46);
    }
  }
}
