// tapml's WebGPU runtime: executes KernelPrograms sent by a tapml host over a WebSocket.
//
// Protocol (the host side is tapml/platforms/browser.py and page_bridge.py):
//   page -> host  text   {"type": "hello", adapter, features, limits} or {"type": "hello", error}
//   host -> page  text   {"type": "welcome", max_programs, max_bytes}: how many prepared programs (and bytes
//                        of their buffers) the page keeps, least recently used dropped first; sent before any run
//   host -> page  text   {"type": "run", id, key, program | null, inputs: [name], outputs: [[name, nbytes]],
//                         held: [name], copies: [[name, key, buffer, nbytes]]}
//                        (a program may hold guards: {buffer name: byte where its guard starts}, see GUARD_BYTES)
//                        inputs: the input buffers written from this run's frames; held: input buffers that keep
//                        what an earlier run wrote (weights cross once); copies: input buffers filled on the GPU
//                        from an output buffer another run left there (program key, buffer: resident state);
//                        outputs: the outputs read back (the others stay in their buffers, for copies and reads)
//   host -> page  binary one frame per const buffer (only when program is sent), then one per input
//   host -> page  text   {"type": "read", id, key, outputs: [[name, nbytes]]}: read buffers a run left (no frames)
//   page -> host  binary one frame per output, then text {"type": "done", id, gpu_ms}
//                 or text {"type": "error", id, code, message}
//                 (code: no-program | no-input (a held buffer was never written) | no-resident | compile | run)
//   page -> host  text   {"type": "lost", message} when the GPU device is lost
// Binary frames (frames.js) start with a 16-byte header: "TPT1", u32 run id, u32 slot, u32 kind
// (0 input, 1 const, 2 output), little-endian; the payload is the tensor's device bytes.

import { FRAME_MAGIC, HEADER_BYTES, KIND, frame, parseFrame } from "./frames.js";

export { FRAME_MAGIC, HEADER_BYTES, KIND, frame, parseFrame };

const align4 = (n) => Math.max(4, Math.ceil(n / 4) * 4);
// Guard regions (the host's enable_guards): GUARD_BYTES after each guarded buffer, inside its binding, filled
// with the same sentinel as platforms/wgpu_native.py's, so that a write past the tensor lands where it is seen.
export const GUARD_BYTES = 256;
const SENTINEL = new Uint8Array(GUARD_BYTES).map((_, i) => [0xa5, 0x5a, 0xc3, 0x3c][i % 4]);
const kebab = (name) => name.replace(/[A-Z]/g, (c) => "-" + c.toLowerCase());

function gatherLimits(limits) {
  const out = {};
  for (const name in limits) {
    if (typeof limits[name] === "number") out[kebab(name)] = limits[name];
  }
  return out;
}

// Limits worth raising to the adapter's maximum: kernels bind many buffers and big tensors.
const WANTED_LIMITS = [
  "maxStorageBuffersPerShaderStage", "maxStorageBufferBindingSize", "maxBufferSize",
  "maxComputeWorkgroupsPerDimension", "maxComputeInvocationsPerWorkgroup", "maxComputeWorkgroupSizeX",
  "maxComputeWorkgroupSizeY", "maxComputeWorkgroupSizeZ", "maxComputeWorkgroupStorageSize",
  "maxBindingsPerBindGroup",
];

/** Opens the adapter and device; returns {device, hello} or throws with a reason for the host. */
export async function openDevice() {
  if (!globalThis.isSecureContext) {
    throw new Error("this page is not a secure context, so the browser hides WebGPU; open it via " +
                    "http://127.0.0.1 or http://localhost (e.g. through `ssh -L` or `adb reverse`), or over https");
  }
  if (!navigator.gpu) {
    throw new Error("navigator.gpu is missing: this browser has no WebGPU (Chromium needs --enable-unsafe-webgpu " +
                    "on Linux; use a recent Chrome, Edge, or Safari 26+)");
  }
  const adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
  if (!adapter) {
    throw new Error("navigator.gpu.requestAdapter() returned no adapter (no usable GPU or Vulkan driver)");
  }
  const requiredLimits = {};
  for (const name of WANTED_LIMITS) {
    if (name in adapter.limits) requiredLimits[name] = adapter.limits[name];
  }
  const requiredFeatures = ["shader-f16"].filter((f) => adapter.features.has(f));
  const device = await adapter.requestDevice({ requiredLimits, requiredFeatures });
  const info = adapter.info ?? {};
  const hello = {
    type: "hello",
    adapter: { vendor: info.vendor ?? "", architecture: info.architecture ?? "", device: info.device ?? "",
               description: info.description ?? "" },
    features: [...device.features].sort(),
    limits: gatherLimits(device.limits),
    userAgent: navigator.userAgent,
  };
  return { device, hello };
}

/** Executes KernelPrograms on one GPUDevice; pipelines, bind groups and buffers are cached per program key. */
export class KernelRuntime {
  constructor(device) {
    this.device = device;
    this.programs = new Map(); // key -> prepared program, in least-recently-used order
    this.modules = new Map();  // WGSL source -> GPUShaderModule, shared across programs
    this.limits = null;        // {max_programs, max_bytes} from the host's welcome
    this.bytes = 0;            // buffer bytes of the prepared programs
  }

  /** The host's cache limits (its ProgramCache's); until they arrive nothing is prepared. */
  setLimits(maxPrograms, maxBytes) {
    if (!(maxPrograms >= 1) || !(maxBytes >= 1)) throw new Error("welcome without positive cache limits");
    this.limits = { maxPrograms, maxBytes };
  }

  has(key) {
    return this.programs.has(key);
  }

  async prepare(key, program, consts) {
    if (!this.limits) throw Object.assign(new Error("the host sent no welcome with cache limits"), { code: "compile" });
    const device = this.device;
    const buffers = new Map();
    const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
    const guarded = new Map(Object.entries(program.guards ?? {})); // name -> where its guard starts
    program.buffers.forEach((spec) => {
      const size = align4(spec.size) + (guarded.has(spec.name) ? GUARD_BYTES : 0);
      buffers.set(spec.name, device.createBuffer({ label: spec.name, size, usage }));
    });
    program.consts.forEach((name, i) => device.queue.writeBuffer(buffers.get(name), 0, padded(consts[i])));
    device.pushErrorScope("validation");
    const kernels = [];
    try {
      for (const k of program.kernels) {
        const module = await this.shaderModule(k.wgsl);
        const layout = device.createBindGroupLayout({
          entries: k.bindings.map(([, access], binding) => ({
            binding, visibility: GPUShaderStage.COMPUTE,
            buffer: { type: access === "read" ? "read-only-storage" : access === "uniform" ? "uniform" : "storage" },
          })),
        });
        const pipeline = await device.createComputePipelineAsync({
          label: k.name, layout: device.createPipelineLayout({ bindGroupLayouts: [layout] }),
          compute: { module, entryPoint: k.entry ?? "main" },
        });
        const bindGroup = device.createBindGroup({
          // a 4-item binding is a window [offset, offset + size) of a buffer over the binding limit
          layout, entries: k.bindings.map(([name, , offset, size], binding) => ({
            binding, resource: offset === undefined ? { buffer: buffers.get(name) } : { buffer: buffers.get(name), offset, size },
          })),
        });
        // the guards this kernel could write, copied out after it runs to pin a bad write on it
        const snapshots = [...new Set(k.bindings.filter(([n, a]) => a === "read_write" && guarded.has(n)).map(([n]) => n))];
        kernels.push({ pipeline, bindGroup, workgroups: k.workgroups, name: k.name, snapshots });
      }
    } catch (e) {
      await device.popErrorScope();
      buffers.forEach((b) => b.destroy());
      throw Object.assign(new Error(`${e.message ?? e}`), { code: "compile" });
    }
    const error = await device.popErrorScope();
    if (error) {
      buffers.forEach((b) => b.destroy());
      throw Object.assign(new Error(error.message), { code: "compile" });
    }
    // Outputs start as 0xFF bytes each run (NaN / -1 / an invalid bool), so elements no kernel wrote show up.
    const poison = (program.poison ?? []).map((name) => {
      const buffer = buffers.get(name);
      return { buffer, bytes: new Uint8Array(buffer.size).fill(0xff) };
    });
    let bytes = 0;
    buffers.forEach((b) => { bytes += b.size; });
    const slots = kernels.reduce((n, k) => n + k.snapshots.length, 0);
    const guards = slots === 0 ? null : {
      starts: guarded, slots,
      readback: device.createBuffer({ size: slots * GUARD_BYTES, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST }),
    };
    if (guards) bytes += slots * GUARD_BYTES;
    // filled: input buffers some run wrote (only those may be "held")
    const prepared = { buffers, kernels, poison, staging: new Map(), bytes, guards, filled: new Set() };
    this.remember(key, prepared);
    return prepared;
  }

  async shaderModule(wgsl) {
    let module = this.modules.get(wgsl);
    if (!module) {
      module = this.device.createShaderModule({ code: wgsl });
      const info = await module.getCompilationInfo();
      const errors = info.messages.filter((m) => m.type === "error");
      if (errors.length) {
        throw new Error("WGSL compile error: " + errors.map((m) => `${m.lineNum}:${m.linePos} ${m.message}`).join("; "));
      }
      this.modules.set(wgsl, module);
    }
    return module;
  }

  remember(key, prepared) {
    const old = this.programs.get(key);
    if (old) this.drop(key, old);
    this.programs.set(key, prepared);
    this.bytes += prepared.bytes;
    const { maxPrograms, maxBytes } = this.limits;
    while (this.programs.size > 1 && (this.programs.size > maxPrograms || this.bytes > maxBytes)) {
      const [oldKey, oldest] = this.programs.entries().next().value;
      this.drop(oldKey, oldest);
    }
    if (this.modules.size > 4 * maxPrograms) this.modules.clear();
  }

  drop(key, prepared) {
    this.programs.delete(key);
    this.bytes -= prepared.bytes;
    prepared.buffers.forEach((b) => b.destroy());
    prepared.staging.forEach((b) => b.destroy());
    if (prepared.guards) prepared.guards.readback.destroy();
  }

  /** Marks a program as just used (it is kept over others while a run that needs it prepares). */
  touch(key) {
    const prepared = this.programs.get(key);
    if (prepared) {
      this.programs.delete(key);
      this.programs.set(key, prepared);
    }
  }

  /** Uploads inputs, dispatches every kernel in one submission, reads outputs back: [Uint8Array].
   *  held: input buffers that keep an earlier run's data; copies: [input, program key, output buffer, bytes]. */
  async run(key, inputs, inputData, outputs, held = [], copies = []) {
    const prepared = this.programs.get(key);
    this.touch(key);
    const device = this.device;
    const missing = held.filter((name) => !prepared.filled.has(name));
    if (missing.length) {
      throw Object.assign(new Error(`input buffers ${missing.join(", ")} were never written`), { code: "no-input" });
    }
    const sources = copies.map(([name, srcKey, srcName, nbytes]) => {
      const src = this.programs.get(srcKey)?.buffers.get(srcName);
      if (!src) throw Object.assign(new Error(`program ${srcKey} is no longer on the page`), { code: "no-resident" });
      return { dst: prepared.buffers.get(name), src, nbytes, name };
    });
    if (sources.length) {
      // submitted before the outputs are poisoned below: a program may read its own previous output
      const copy = device.createCommandEncoder();
      sources.forEach(({ dst, src, nbytes }) => { if (dst !== src) copy.copyBufferToBuffer(src, 0, dst, 0, nbytes); });
      device.queue.submit([copy.finish()]);
      sources.forEach(({ name }) => prepared.filled.add(name));
    }
    prepared.poison.forEach((p) => device.queue.writeBuffer(p.buffer, 0, p.bytes));
    inputs.forEach((name, i) => {
      device.queue.writeBuffer(prepared.buffers.get(name), 0, padded(inputData[i]));
      prepared.filled.add(name);
    });
    device.pushErrorScope("out-of-memory");
    device.pushErrorScope("validation");
    const encoder = device.createCommandEncoder();
    const guards = prepared.guards;
    const snapshots = []; // [kernel name, buffer name] per guard slot, in dispatch order
    if (guards) {
      guards.starts.forEach((start, name) => device.queue.writeBuffer(prepared.buffers.get(name), start, SENTINEL));
      for (const k of prepared.kernels) {
        const pass = encoder.beginComputePass();
        pass.setPipeline(k.pipeline);
        pass.setBindGroup(0, k.bindGroup);
        pass.dispatchWorkgroups(...k.workgroups);
        pass.end();
        for (const name of k.snapshots) {
          encoder.copyBufferToBuffer(prepared.buffers.get(name), guards.starts.get(name), guards.readback,
                                     snapshots.length * GUARD_BYTES, GUARD_BYTES);
          snapshots.push([k.name, name]);
        }
      }
    } else {
      const pass = encoder.beginComputePass();
      for (const k of prepared.kernels) {
        pass.setPipeline(k.pipeline);
        pass.setBindGroup(0, k.bindGroup);
        pass.dispatchWorkgroups(...k.workgroups);
      }
      pass.end();
    }
    const reads = this.copyOut(prepared, encoder, outputs);
    device.queue.submit([encoder.finish()]);
    const validation = await device.popErrorScope();
    const oom = await device.popErrorScope();
    if (validation || oom) throw Object.assign(new Error((validation ?? oom).message), { code: "run" });
    const out = await mapped(reads);
    if (guards) await checkGuards(guards.readback, snapshots, guards.starts);
    return out;
  }

  /** Reads back output buffers an earlier run of program key left on the page: [Uint8Array]. */
  async read(key, outputs) {
    const prepared = this.programs.get(key);
    if (!prepared) throw Object.assign(new Error(`program ${key} is no longer on the page`), { code: "no-program" });
    const encoder = this.device.createCommandEncoder();
    const reads = this.copyOut(prepared, encoder, outputs);
    this.device.queue.submit([encoder.finish()]);
    return mapped(reads);
  }

  /** Records copies of output buffers into their staging buffers: [{staging, nbytes}]. */
  copyOut(prepared, encoder, outputs) {
    return outputs.map(([name, nbytes]) => {
      const size = align4(nbytes);
      const stagingKey = `${name}:${size}`;
      let staging = prepared.staging.get(stagingKey);
      if (!staging) {
        staging = this.device.createBuffer({ size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
        prepared.staging.set(stagingKey, staging);
      }
      encoder.copyBufferToBuffer(prepared.buffers.get(name), 0, staging, 0, size);
      return { staging, nbytes };
    });
  }
}

async function mapped(reads) {
  await Promise.all(reads.map((r) => r.staging.mapAsync(GPUMapMode.READ)));
  return reads.map((r) => {
    const bytes = new Uint8Array(r.staging.getMappedRange(0, align4(r.nbytes)).slice(0, r.nbytes));
    r.staging.unmap();
    return bytes;
  });
}

/** Throws (code "run") naming the first kernel that wrote into a guard, the buffer and the first bad byte. */
async function checkGuards(readback, snapshots, starts) {
  await readback.mapAsync(GPUMapMode.READ);
  const data = new Uint8Array(readback.getMappedRange().slice(0));
  readback.unmap();
  for (let slot = 0; slot < snapshots.length; slot++) {
    const guard = data.subarray(slot * GUARD_BYTES, (slot + 1) * GUARD_BYTES);
    const bad = [];
    guard.forEach((b, i) => { if (b !== SENTINEL[i]) bad.push(i); });
    if (bad.length) {
      const [kernel, name] = snapshots[slot];
      throw Object.assign(new Error(`kernel ${kernel} wrote past buffer ${name} (${starts.get(name)} bytes): first bad ` +
                                    `byte at offset +${bad[0]} after its end (last at +${bad[bad.length - 1]} of the ` +
                                    `${GUARD_BYTES}-byte guard)`), { code: "run" });
    }
  }
}

function padded(bytes) {
  if (bytes.byteLength % 4 === 0) return bytes;
  const out = new Uint8Array(align4(bytes.byteLength));
  out.set(bytes);
  return out;
}

/** Connects the page to the tapml host that served it and executes its runs until closed. */
export async function start(statusElement) {
  const status = (text) => { if (statusElement) statusElement.textContent = text; };
  const url = new URL("ws", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  await new Promise((resolve, reject) => {
    ws.onopen = resolve;
    ws.onerror = () => reject(new Error("cannot connect to the tapml host (URL already used by another page, " +
                                        "page opened under another address, or host gone)"));
  }).catch((e) => { status(e.message); throw e; });
  let runtime;
  try {
    const { device, hello } = await openDevice();
    runtime = new KernelRuntime(device);
    device.lost.then((info) => {
      status(`device lost: ${info.message}`);
      if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "lost", message: info.message || info.reason }));
    });
    ws.send(JSON.stringify(hello));
    status(`tapml device: ${hello.adapter.vendor} ${hello.adapter.architecture} — waiting for work`);
  } catch (e) {
    ws.send(JSON.stringify({ type: "hello", error: `${e.message ?? e}` }));
    status(`no WebGPU: ${e.message ?? e}`);
    return;
  }

  let pending = null; // the run whose binary frames are arriving
  let queue = Promise.resolve();
  let done = 0;
  const finish = (job) => {
    queue = queue.then(() => execute(job)).catch((e) => console.error(e));
  };
  const execute = async (job) => {
    const { msg, consts, inputs } = job;
    try {
      if (msg.type === "read") {
        const outputs = await runtime.read(msg.key, msg.outputs);
        outputs.forEach((bytes, slot) => ws.send(frame(msg.id, slot, KIND.output, bytes)));
        ws.send(JSON.stringify({ type: "done", id: msg.id, gpu_ms: 0 }));
        return;
      }
      (msg.copies ?? []).forEach(([, srcKey]) => runtime.touch(srcKey));
      if (msg.program) await runtime.prepare(msg.key, msg.program, consts);
      else if (!runtime.has(msg.key)) throw Object.assign(new Error("program not cached"), { code: "no-program" });
      const t0 = performance.now();
      const outputs = await runtime.run(msg.key, msg.inputs, inputs, msg.outputs, msg.held ?? [], msg.copies ?? []);
      const gpuMs = performance.now() - t0;
      outputs.forEach((bytes, slot) => ws.send(frame(msg.id, slot, KIND.output, bytes)));
      ws.send(JSON.stringify({ type: "done", id: msg.id, gpu_ms: gpuMs }));
      status(`tapml device: ${++done} runs`);
    } catch (e) {
      ws.send(JSON.stringify({ type: "error", id: msg.id, code: e.code ?? "run", message: `${e.message ?? e}` }));
    }
  };
  ws.onmessage = (event) => {
    if (typeof event.data === "string") {
      const msg = JSON.parse(event.data);
      if (msg.type === "welcome") { runtime.setLimits(msg.max_programs, msg.max_bytes); return; }
      if (msg.type !== "run" && msg.type !== "read") return;
      const nconsts = msg.program ? msg.program.consts.length : 0;
      const ninputs = msg.type === "run" ? msg.inputs.length : 0;
      pending = { msg, consts: new Array(nconsts), inputs: new Array(ninputs), missing: nconsts + ninputs };
      if (pending.missing === 0) { finish(pending); pending = null; }
      return;
    }
    const f = parseFrame(event.data);
    if (!pending || f.id !== pending.msg.id) return;
    (f.kind === KIND.const ? pending.consts : pending.inputs)[f.slot] = f.payload;
    if (--pending.missing === 0) { finish(pending); pending = null; }
  };
  // Each URL attaches one page: after a disconnect, tapml serve --no-launch prints a fresh one.
  ws.onclose = () => status("disconnected from the tapml host; open the new URL it printed to attach again");
}
