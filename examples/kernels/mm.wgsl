// aten.mm.default, float32: c[M, N] = a[M, K] @ b[K, N], one invocation per element of c.
// tapml's binding convention (README, "Your own kernels"): the tensor inputs, then the outputs,
// then the u32 shapes buffer; every tensor is contiguous.
@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<storage, read> shapes: array<u32>;

// tensor k's record starts at word 4 + 18 k: rank, element count, 8 sizes, 8 strides
const A: u32 = 4u;   // a, input 0
const B: u32 = 22u;  // b, input 1

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.y * shapes[3] + gid.x;
  if (i >= shapes[2]) { return; }
  let k_len = shapes[A + 3u];  // a's size 1: K
  let n_len = shapes[B + 3u];  // b's size 1: N
  let row = i / n_len;
  let col = i % n_len;
  var acc: f32 = 0.0;
  for (var k: u32 = 0u; k < k_len; k = k + 1u) {
    acc = acc + a[row * k_len + k] * b[k * n_len + col];
  }
  c[i] = acc;
}
