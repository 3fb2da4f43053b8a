// Reproduce one tapml case in any WebGPU browser: run the WGSL kernels that plan.json lists with the
// recorded inputs and compare the outputs with the reference's, by the rule of run.py. Served over
// http(s) the page fetches the folder's files; opened from disk it asks for them (<input type=file multiple>).
// The verdict goes into #result (text starting with PASS or FAIL; "CANNOT RUN" when this browser cannot).
// plan.json is data: it may name only plain file names of this folder, and nothing from it is ever run
// or put into the page as HTML.

const FILE_NAME = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,120}$/;
const WORST = 5;
const WANTED_LIMITS = [
  "maxStorageBuffersPerShaderStage", "maxStorageBufferBindingSize", "maxBufferSize",
  "maxComputeWorkgroupsPerDimension", "maxComputeInvocationsPerWorkgroup", "maxComputeWorkgroupSizeX",
  "maxComputeWorkgroupSizeY", "maxComputeWorkgroupSizeZ", "maxComputeWorkgroupStorageSize",
  "maxBindingsPerBindGroup",
];

class CannotRun extends Error {}
class KernelFailure extends Error {}

const show = (id, text) => { document.getElementById(id).textContent = text; };
const align4 = (n) => Math.max(4, Math.ceil(n / 4) * 4);

/** A file source: fetch next to the page, or the files a person picked. Returns ArrayBuffers. */
function fetchSource() {
  return async (name) => {
    checkName(name);
    const response = await fetch(new URL(name, location.href));
    if (!response.ok) throw new CannotRun(`${name}: HTTP ${response.status}; serve the whole repro folder`);
    return response.arrayBuffer();
  };
}

function pickedSource(files) {
  const byName = new Map([...files].map((f) => [f.name, f]));
  return async (name) => {
    checkName(name);
    const file = byName.get(name);
    if (!file) throw new CannotRun(`${name} was not picked; pick every file of the repro folder`);
    return file.arrayBuffer();
  };
}

function checkName(name) {
  if (typeof name !== "string" || !FILE_NAME.test(name) || name.includes("..")) {
    throw new CannotRun(`plan.json names ${JSON.stringify(String(name)).slice(0, 80)}, not a plain file name`);
  }
}

/** A .npy file: {descr, shape, data: ArrayBuffer}. */
function parseNpy(buffer, name) {
  const bytes = new Uint8Array(buffer);
  const magic = String.fromCharCode(...bytes.subarray(1, 6));
  if (bytes[0] !== 0x93 || magic !== "NUMPY") throw new CannotRun(`${name} is not a .npy file`);
  const view = new DataView(buffer);
  const major = bytes[6];
  const headerLength = major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const start = major === 1 ? 10 : 12;
  const header = new TextDecoder("latin1").decode(bytes.subarray(start, start + headerLength));
  const descr = /'descr':\s*'([^']+)'/.exec(header)?.[1];
  const fortran = /'fortran_order':\s*True/.test(header);
  const shapeText = /'shape':\s*\(([^)]*)\)/.exec(header)?.[1];
  if (!descr || fortran || shapeText === undefined) throw new CannotRun(`${name}: unexpected .npy header ${header}`);
  const shape = shapeText.split(",").map((s) => s.trim()).filter((s) => s).map(Number);
  return { descr, shape, data: buffer.slice(start + headerLength) };
}

function halfToFloat(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const frac = h & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

/** Numbers of a typed buffer: numpy descr ('<f4', '<i8', '|b1', ...) or WGSL type ('f32', 'u32', ...). */
function numbers(kind, data, count) {
  const take = (Typed) => Array.from(new Typed(data, 0, count));
  switch (kind) {
    case "<f4": case "f32": return take(Float32Array);
    case "<f8": return take(Float64Array);
    case "<f2": case "f16": return Array.from(new Uint16Array(data, 0, count), halfToFloat);
    case "<i4": case "i32": return take(Int32Array);
    case "<u4": case "u32": return take(Uint32Array);
    case "<i2": return take(Int16Array);
    case "|i1": return take(Int8Array);
    case "|u1": case "|b1": return take(Uint8Array);
    case "<i8": return Array.from(new BigInt64Array(data, 0, count), Number);
    default: throw new CannotRun(`unsupported element type ${kind}`);
  }
}

const isFloat = (dtype) => dtype.startsWith("float");

function unravel(i, shape) {
  const index = new Array(shape.length);
  for (let d = shape.length - 1; d >= 0; d--) { index[d] = i % shape[d]; i = Math.floor(i / shape[d]); }
  return index;
}

/** tapml's comparison rule, in float64, with the same stats as run.py. */
function compare(t, r, shape, dtype, rtol, atol) {
  const n = r.length;
  if (n === 0) return { passed: true, max_abs_err: 0, max_rel_err: 0, mismatch_fraction: 0, message: "", worst: [] };
  const diff = new Float64Array(n), rel = new Float64Array(n), bad = new Uint8Array(n);
  let special = 0;
  for (let i = 0; i < n; i++) {
    const a = t[i], b = r[i];
    if (!isFloat(dtype)) {
      diff[i] = Math.abs(a - b);
      rel[i] = diff[i] / Math.max(Math.abs(b), 1e-300);
      bad[i] = a !== b ? 1 : 0;
      continue;
    }
    const sp = Number.isNaN(a) !== Number.isNaN(b) || (!Number.isFinite(a) && !Number.isNaN(a)) !== (!Number.isFinite(b) && !Number.isNaN(b))
      || (!Number.isFinite(b) && !Number.isNaN(b) && a !== b);
    const finite = Number.isFinite(a) && Number.isFinite(b);
    const d = finite ? Math.abs(a - b) : 0;
    if (sp) { special++; diff[i] = Infinity; rel[i] = Infinity; bad[i] = 1; continue; }
    diff[i] = d;
    rel[i] = d / Math.max(Math.abs(b), 1e-30);
    bad[i] = finite && d > atol + rtol * Math.abs(b) ? 1 : 0;
  }
  let nBad = 0, maxAbs = 0, maxRel = 0;
  for (let i = 0; i < n; i++) { nBad += bad[i]; maxAbs = Math.max(maxAbs, diff[i]); maxRel = Math.max(maxRel, rel[i]); }
  const order = [];
  for (let i = 0; i < n; i++) if (bad[i]) order.push(i);
  order.sort((x, y) => diff[y] - diff[x] || x - y);
  const fmt = (v) => (Number.isFinite(v) ? v : String(v));
  const worst = order.slice(0, WORST).map((i) => ({ index: unravel(i, shape), target: fmt(t[i]), reference: fmt(r[i]) }));
  let msg = isFloat(dtype) ? `values exceed rtol=${rtol} atol=${atol}` : "values differ (exact match required)";
  if (special) msg += `; NaN/Inf differ at ${special} positions`;
  return { passed: nBad === 0, max_abs_err: Number.isFinite(maxAbs) ? maxAbs : null,
           max_rel_err: Number.isFinite(maxRel) ? maxRel : null, mismatch_fraction: nBad / n,
           message: nBad ? `${nBad}/${n} elements mismatch: ${msg}` : "", worst };
}

function merge(results) {
  if (results.length === 1) return results[0];
  const worstOf = (k) => (results.some((c) => c[k] === null) ? null : Math.max(0, ...results.map((c) => c[k])));
  const failed = results.map((c, i) => [i, c]).filter(([, c]) => !c.passed);
  return { passed: failed.length === 0, max_abs_err: worstOf("max_abs_err"), max_rel_err: worstOf("max_rel_err"),
           mismatch_fraction: worstOf("mismatch_fraction"),
           message: failed.map(([i, c]) => `output ${i}: ${c.message}`).join("; "), worst: failed.length ? failed[0][1].worst : [] };
}

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
  const fmt = (x) => (x === null ? "-" : Number(x).toPrecision(6));
  const subject = plan.subject ?? {};
  show("result", `${status === "pass" ? "PASS" : "FAIL"} ${status}: ${subject.kind ?? ""} ${subject.label ?? ""} on ${adapter}\n` +
                 `max_abs_err ${fmt(result.max_abs_err)}  max_rel_err ${fmt(result.max_rel_err)}  ` +
                 `mismatch_fraction ${fmt(result.mismatch_fraction)}`);
  const seen = plan.observed ?? {};
  show("details", [result.message, ...result.worst.map((w) => `at [${w.index}]: got ${w.target}, expected ${w.reference}`),
                   `tapml saw on ${plan.target}: ${seen.status}, max_abs_err ${fmt(seen.max_abs_err ?? null)}`,
                   `result as JSON: ${JSON.stringify({ status, ...result, adapter: info })}`].filter((x) => x).join("\n"));
}

async function main() {
  const fail = (e) => show("result", e instanceof CannotRun ? `CANNOT RUN: ${e.message}` : `CANNOT RUN: ${e.message ?? e}`);
  if (location.protocol === "http:" || location.protocol === "https:") {
    try { await reproduce(fetchSource()); } catch (e) { fail(e); }
    return;
  }
  document.getElementById("pick").style.display = "block";
  show("result", "waiting for the repro folder's files…");
  document.getElementById("files").addEventListener("change", async (event) => {
    show("result", "running…");
    show("details", "");
    try { await reproduce(pickedSource(event.target.files)); } catch (e) { fail(e); }
  });
}

main();
