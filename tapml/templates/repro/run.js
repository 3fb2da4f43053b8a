// Reproduce one tapml case in any WebGPU browser: run the WGSL kernels that plan.json lists with the
// recorded inputs and compare the outputs with the reference's, by the rule of run.py. Served over
// http(s) the page fetches the folder's files; opened from disk it asks for them (<input type=file multiple>).
// The verdict goes into #result (text starting with PASS or FAIL; "CANNOT RUN" when this browser cannot).
// plan.json is data: it may name only plain file names of this folder, and nothing from it is ever run
// or put into the page as HTML.

const WANTED_LIMITS = [
  "maxStorageBuffersPerShaderStage", "maxStorageBufferBindingSize", "maxBufferSize",
  "maxComputeWorkgroupsPerDimension", "maxComputeInvocationsPerWorkgroup", "maxComputeWorkgroupSizeX",
  "maxComputeWorkgroupSizeY", "maxComputeWorkgroupSizeZ", "maxComputeWorkgroupStorageSize",
  "maxBindingsPerBindGroup",
];

class KernelFailure extends Error {}

const align4 = (n) => Math.max(4, Math.ceil(n / 4) * 4);

async function openDevice() {
  if (!navigator.gpu) throw new CannotRun("navigator.gpu is missing: this browser has no WebGPU here (a secure context " +
                                         "is needed: http://127.0.0.1 or localhost, https, or a file opened from disk)");
  const adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
  if (!adapter) throw new CannotRun("navigator.gpu.requestAdapter() returned no adapter");
  const requiredLimits = {};
  for (const name of WANTED_LIMITS) if (name in adapter.limits) requiredLimits[name] = adapter.limits[name];
  const requiredFeatures = ["shader-f16", "subgroups"].filter((f) => adapter.features.has(f));
  const device = await adapter.requestDevice({ requiredLimits, requiredFeatures });
  return { device, info: adapter.info ?? {} };
}

async function runKernels(plan, read, device) {
  const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
  const buffers = new Map();
  const specs = new Map(plan.buffers.map((b) => [b.name, b]));
  for (const b of plan.buffers) {
    if (b.size === 0) continue;
    buffers.set(b.name, device.createBuffer({ label: b.name, size: align4(b.size), usage }));
    if (b.role === "const") device.queue.writeBuffer(buffers.get(b.name), 0, padded(new Uint8Array(await read(b.file))));
  }
  const kernels = [];
  device.pushErrorScope("validation");
  for (const k of plan.kernels) {
    const code = new TextDecoder().decode(await read(k.file));
    const module = device.createShaderModule({ code });
    const info = await module.getCompilationInfo();
    const errors = info.messages.filter((m) => m.type === "error");
    if (errors.length) {
      await device.popErrorScope();
      throw new KernelFailure(`kernel ${k.name} (${k.file}) does not compile: ` +
                              errors.map((m) => `${m.lineNum}:${m.linePos} ${m.message}`).join("; "));
    }
    const layout = device.createBindGroupLayout({
      entries: k.bindings.map(([, access], binding) => ({
        binding, visibility: GPUShaderStage.COMPUTE, buffer: { type: access === "read" ? "read-only-storage" : "storage" },
      })),
    });
    const pipeline = device.createComputePipeline({
      label: k.name, layout: device.createPipelineLayout({ bindGroupLayouts: [layout] }),
      compute: { module, entryPoint: k.entry ?? "main" },
    });
    const bindGroup = device.createBindGroup({
      // a 4-item binding is a byte window [offset, offset + size) of a buffer over the binding limit
      layout, entries: k.bindings.map(([name, , offset, size], binding) => ({
        binding, resource: offset === undefined ? { buffer: buffers.get(name) } : { buffer: buffers.get(name), offset, size },
      })),
    });
    kernels.push({ pipeline, bindGroup, workgroups: k.workgroups });
  }
  const refused = await device.popErrorScope();
  if (refused) throw new KernelFailure(`the device refused the kernels: ${refused.message}`);
  for (const input of plan.inputs) {
    const npy = parseNpy(await read(input.file), input.file);
    if (!buffers.has(input.buffer)) continue;
    device.queue.writeBuffer(buffers.get(input.buffer), 0, padded(new Uint8Array(npy.data)));
  }
  for (const out of plan.outputs) {
    const spec = specs.get(out.buffer);
    if (spec && spec.role === "output" && buffers.has(out.buffer)) {
      device.queue.writeBuffer(buffers.get(out.buffer), 0, new Uint8Array(align4(spec.size)).fill(0xff));
    }
  }
  device.pushErrorScope("out-of-memory");
  device.pushErrorScope("validation");
  const encoder = device.createCommandEncoder();
  const pass = encoder.beginComputePass();
  for (const k of kernels) {
    pass.setPipeline(k.pipeline);
    pass.setBindGroup(0, k.bindGroup);
    pass.dispatchWorkgroups(...k.workgroups);
  }
  pass.end();
  const reads = plan.outputs.map((out) => {
    if (!buffers.has(out.buffer)) return null;
    const size = align4(specs.get(out.buffer).size);
    const staging = device.createBuffer({ size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    encoder.copyBufferToBuffer(buffers.get(out.buffer), 0, staging, 0, size);
    return staging;
  });
  device.queue.submit([encoder.finish()]);
  const validation = await device.popErrorScope();
  const oom = await device.popErrorScope();
  if (validation || oom) throw new KernelFailure(`running the kernels failed: ${(validation ?? oom).message}`);
  const outputs = [];
  for (const [i, staging] of reads.entries()) {
    if (!staging) { outputs.push(new ArrayBuffer(0)); continue; }
    await staging.mapAsync(GPUMapMode.READ);
    outputs.push(staging.getMappedRange().slice(0));
    staging.unmap();
  }
  return outputs;
}

function padded(bytes) {
  if (bytes.byteLength % 4 === 0 && bytes.byteLength > 0) return bytes;
  const out = new Uint8Array(align4(bytes.byteLength));
  out.set(bytes);
  return out;
}

async function reproduce(read) {
  const plan = JSON.parse(new TextDecoder().decode(await read("plan.json")));
  if (plan.format !== "tapml-repro/1") throw new CannotRun("plan.json is not a tapml-repro/1 plan");
  const { device, info } = await openDevice();
  const adapter = [info.vendor, info.architecture, info.device, info.description].filter((x) => x).join(" ") || "unknown adapter";
  let result, status;
  try {
    const raw = await runKernels(plan, read, device);
    const results = [];
    for (const [i, out] of plan.outputs.entries()) {
      const count = out.shape.reduce((a, b) => a * b, 1);
      let got = count ? numbers(out.device_type, raw[i], count) : [];
      if (out.device_type === "u32") {
        const unwritten = got.filter((v) => v !== 0 && v !== 1).length;
        if (unwritten) throw new KernelFailure(`${unwritten} elements of bool output ${out.buffer} were never written`);
      }
      if (out.device_type === "f16" || out.device_type === "f32") got = got.map(Number);
      const npy = parseNpy(await read(out.expected), out.expected);
      const want = count ? numbers(npy.descr, npy.data, count) : [];
      results.push(compare(got, want, out.shape, out.dtype, out.rtol, out.atol));
    }
    result = merge(results);
    status = result.passed ? "pass" : "mismatch";
  } catch (e) {
    if (!(e instanceof KernelFailure)) throw e;
    result = { passed: false, max_abs_err: null, max_rel_err: null, mismatch_fraction: null, message: e.message, worst: [] };
    status = "error";
  }
  showVerdict(plan, status, result, adapter, info);
}

startPage(reproduce);
