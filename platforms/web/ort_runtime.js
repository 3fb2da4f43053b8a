// tapml's ONNX Runtime Web runtime: runs the ONNX models a tapml host sends, with onnxruntime-web, on the
// execution provider the page URL names (?provider=webgpu or ?provider=wasm).
//
// Protocol (the host side is tapml/platforms/ort_web.py over page_bridge.py; frames as in runtime.js):
//   page -> host  text   {"type": "hello", provider, ort, adapter, features, userAgent} or {"type": "hello", error}
//   host -> page  text   {"type": "load", id, key} + one const frame: the model's ONNX bytes; the page creates
//                        the session once per key and answers {"type": "done", id, inputs, outputs, ms}
//   host -> page  text   {"type": "run", id, key, inputs: [{name, type, dims, digest, slot}]}: slot >= 0 is this
//                        run's input frame; slot -1 a tensor the page already holds under that digest (weights
//                        cross once); then the input frames
//   page -> host  binary one frame per output, then text {"type": "done", id, outputs: [{type, dims}], ms}
//                 or text {"type": "error", id, code, message}
//                 (code: no-session | no-input (a digest the page does not hold) | load | run)
//   host -> page  text   {"type": "drop", key}: release that session
// The page fetches nothing but this host's own files: onnxruntime-web and its wasm are served from ./ort/.

import { frame, parseFrame, KIND } from "./frames.js";

const ARRAYS = {
  float32: Float32Array, float16: globalThis.Float16Array ?? Uint16Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array,
  int16: Int16Array, int8: Int8Array, uint8: Uint8Array, bool: Uint8Array, uint16: Uint16Array, uint32: Uint32Array,
};
const HELD_BYTES = 1 << 30; // inputs kept by digest, least recently used dropped first

function typed(type, bytes) {
  const Array_ = ARRAYS[type];
  if (!Array_) throw Object.assign(new Error(`onnxruntime-web carries no ${type} tensors`), { code: "run" });
  const copy = bytes.slice(); // aligned, and owned by the tensor
  return new Array_(copy.buffer, 0, copy.byteLength / Array_.BYTES_PER_ELEMENT);
}

function rawBytes(data) {
  if (ArrayBuffer.isView(data)) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  throw new Error(`an output came back as ${typeof data}, not a typed array`);
}

export async function start(statusElement) {
  const status = (text) => { if (statusElement) statusElement.textContent = text; };
  const provider = new URL(location.href).searchParams.get("provider") || "webgpu";
  const url = new URL("ws", location.href);
  url.search = "";
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  await new Promise((resolve, reject) => {
    ws.onopen = resolve;
    ws.onerror = () => reject(new Error("cannot connect to the tapml host"));
  }).catch((e) => { status(e.message); throw e; });
  let ort;
  try {
    ort = await import("./ort/ort.min.mjs");
    ort.env.wasm.wasmPaths = new URL("ort/", location.href).href;
    ort.env.wasm.numThreads = 1; // no cross-origin isolation here, so no shared memory for threads
    ort.env.wasm.proxy = false;
    ort.env.logLevel = "error";
    const hello = { type: "hello", provider, ort: ort.env.versions?.web ?? "", userAgent: navigator.userAgent,
                    adapter: null, features: [] };
    if (provider === "webgpu") {
      if (!navigator.gpu) throw new Error("navigator.gpu is missing: this browser has no WebGPU");
      const adapter = await navigator.gpu.requestAdapter();
      if (!adapter) throw new Error("navigator.gpu.requestAdapter() returned no adapter");
      const info = adapter.info ?? {};
      hello.adapter = { vendor: info.vendor ?? "", architecture: info.architecture ?? "", device: info.device ?? "",
                        description: info.description ?? "" };
      hello.features = [...adapter.features].sort();
      ort.env.webgpu.adapter = adapter; // the session runs on the very adapter reported
    } else if (provider !== "wasm") {
      throw new Error(`unknown provider ${provider}`);
    }
    ws.send(JSON.stringify(hello));
    status(`tapml onnxruntime-web ${hello.ort} on ${provider} — waiting for work`);
  } catch (e) {
    ws.send(JSON.stringify({ type: "hello", error: `${e.message ?? e}` }));
    status(`cannot start onnxruntime-web: ${e.message ?? e}`);
    return;
  }

  // what onnxruntime-web (and the GPU device under it) says while a job runs: sent with the job's answer
  let said = [];
  let heard = null; // while a session is made: reads ONNX Runtime's log lines for its node placement
  for (const level of ["error", "warn", "log", "info", "debug"]) {
    const original = console[level].bind(console);
    console[level] = (...args) => {
      const line = args.map(String).join(" ");
      if (heard) { heard(line); return; }
      if (level === "error" || level === "warn") said.push(line.slice(0, 400));
      original(...args);
    };
  }
  const sessions = new Map(); // key -> InferenceSession
  const held = new Map(); // digest -> ort.Tensor (insertion order = least recently used first)
  let heldBytes = 0;
  const hold = (digest, tensor, nbytes) => {
    held.set(digest, { tensor, nbytes });
    heldBytes += nbytes;
    for (const [old, entry] of held) {
      if (heldBytes <= HELD_BYTES || old === digest) break;
      held.delete(old);
      heldBytes -= entry.nbytes;
    }
  };
  const fail = (id, code, message) => ws.send(JSON.stringify({ type: "error", id, code, message, said: said.slice(0, 8) }));
  const execute = async ({ msg, frames }) => {
    const t0 = performance.now();
    said = [];
    if (msg.type === "drop") {
      const session = sessions.get(msg.key);
      sessions.delete(msg.key);
      if (session) await session.release();
      return;
    }
    if (msg.type === "load") {
      let session;
      const placement = {}; // execution provider -> ["OpType (node name)"], as ONNX Runtime logs its placement
      const toCpu = []; // nodes ONNX Runtime put on the CPU on purpose (shape computations), by name
      let placedOn = null;
      heard = (line) => {
        const chosen = /Force fallback to CPU execution for node: (\S+)/.exec(line);
        if (chosen) { toCpu.push(chosen[1]); return; }
        const on = /Node\(s\) placed on \[(\w+)\]/.exec(line);
        if (on) { placedOn = on[1]; placement[placedOn] = []; return; }
        const node = /VerifyEachNodeIsAssignedToAnEp\]\s+(\S+ \(.*\))\s*$/.exec(line);
        if (node && placedOn) placement[placedOn].push(node[1]);
      };
      try {
        // verbose while the session is made: ONNX Runtime logs where it put each node only then
        session = await ort.InferenceSession.create(frames[0], {
          executionProviders: [provider], graphOptimizationLevel: "all", logSeverityLevel: 0, logVerbosityLevel: 0 });
      } catch (e) {
        return fail(msg.id, "load", `${e.message ?? e}`);
      } finally {
        heard = null;
      }
      sessions.set(msg.key, session);
      ws.send(JSON.stringify({ type: "done", id: msg.id, inputs: session.inputNames, outputs: session.outputNames,
                               placement, to_cpu: toCpu, ms: performance.now() - t0, said: said.slice(0, 8) }));
      return;
    }
    const session = sessions.get(msg.key);
    if (!session) return fail(msg.id, "no-session", `no session for ${msg.key}`);
    const feeds = {};
    const missing = [];
    for (const input of msg.inputs) {
      if (input.slot >= 0) {
        const tensor = new ort.Tensor(input.type, typed(input.type, frames[input.slot]), input.dims);
        hold(input.digest, tensor, frames[input.slot].byteLength);
        feeds[input.name] = tensor;
      } else {
        const entry = held.get(input.digest);
        if (!entry) { missing.push(input.digest); continue; }
        held.delete(input.digest); // most recently used now
        held.set(input.digest, entry);
        feeds[input.name] = entry.tensor;
      }
    }
    if (missing.length) return fail(msg.id, "no-input", `the page no longer holds ${missing.length} input(s)`);
    let results;
    try {
      results = await session.run(feeds, { logSeverityLevel: 3 });
    } catch (e) {
      return fail(msg.id, "run", `${e.message ?? e}`);
    }
    const outputs = [];
    session.outputNames.forEach((name, slot) => {
      const tensor = results[name];
      outputs.push({ type: tensor.type, dims: [...tensor.dims] });
      ws.send(frame(msg.id, slot, KIND.output, rawBytes(tensor.data)));
    });
    ws.send(JSON.stringify({ type: "done", id: msg.id, outputs, ms: performance.now() - t0, said: said.slice(0, 8) }));
    status(`tapml onnxruntime-web on ${provider}: ${sessions.size} sessions`);
  };

  let pending = null; // the message whose binary frames are arriving
  let queue = Promise.resolve();
  const finish = (job) => {
    queue = queue.then(() => execute(job)).catch((e) => fail(job.msg.id, "run", `${e.message ?? e}`));
  };
  ws.onmessage = (event) => {
    if (typeof event.data === "string") {
      const msg = JSON.parse(event.data);
      if (!["load", "run", "drop"].includes(msg.type)) return;
      const count = msg.type === "load" ? 1 : msg.type === "run" ? msg.inputs.filter((i) => i.slot >= 0).length : 0;
      pending = { msg, frames: new Array(count), missing: count };
      if (count === 0) { finish(pending); pending = null; }
      return;
    }
    const f = parseFrame(event.data);
    if (!pending || f.id !== pending.msg.id) return;
    pending.frames[f.slot] = f.payload;
    if (--pending.missing === 0) { finish(pending); pending = null; }
  };
  ws.onclose = () => status("disconnected from the tapml host");
}
