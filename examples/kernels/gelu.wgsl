// aten.gelu.default (approximate='none'), float32: y = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)).
// tapml's binding convention (README, "Your own kernels"): the tensor inputs, then the outputs,
// then the u32 shapes buffer. One invocation per element of the output.
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> shapes: array<u32>;

// erfc(z) for z >= 0 (Abramowitz & Stegun 7.1.26, absolute error under 1.5e-7)
fn erfc_pos(z: f32) -> f32 {
  let t = 1.0 / (1.0 + 0.3275911 * z);
  let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
  return poly * exp(-z * z);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.y * shapes[3] + gid.x;  // shapes[3]: invocations per row of the grid
  if (i >= shapes[2]) { return; }     // shapes[2]: elements of the output
  let v = x[i];
  let e = erfc_pos(abs(v) * 0.7071067811865476);
  // 1 + erf(v / sqrt 2) is 2 - erfc for v >= 0 and erfc for v < 0: no cancellation in the tail
  y[i] = 0.5 * v * select(e, 2.0 - e, v >= 0.0);
}
