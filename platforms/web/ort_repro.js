// Reproduce one tapml case with onnxruntime-web alone: run the folder's model.onnx on the provider of the
// case's target (ort-web:webgpu or ort-web:wasm; ?provider= overrides) with the recorded inputs and compare
// the outputs with the reference's by the rule of run.py (check.js). A WebGPU validation error during the run
// (a kernel onnxruntime-web made that the device refused) is the verdict "error", as tapml judged it.

const ORT_WEB_VERSION = "__ORT_WEB_VERSION__"; // the onnxruntime-web tapml ran
const NPY_OF = { float32: "<f4", float16: "<f2", float64: "<f8", int64: "<i8", int32: "<i4", int16: "<i2", int8: "|i1",
                 uint8: "|u1", bool: "|b1" };

async function loadOrt() {
  const bases = [new URL("ort/", location.href).href, `https://cdn.jsdelivr.net/npm/onnxruntime-web@${ORT_WEB_VERSION}/dist/`];
  let last;
  for (const base of bases) {
    try {
      const ort = await import(base + "ort.min.mjs");
      ort.env.wasm.wasmPaths = base;
      ort.env.wasm.numThreads = 1;
      return ort;
    } catch (e) { last = e; }
  }
  throw new CannotRun(`cannot load onnxruntime-web from ./ort/ or jsDelivr: ${last?.message ?? last}`);
}

/** The program's input names and output count tapml wrote into model.onnx's metadata (tapml.program). */
function signatureOf(model) {
  const text = new TextDecoder("utf-8", { fatal: false }).decode(model);
  const at = text.indexOf('{"inputs"', text.indexOf("tapml.program"));
  if (at < 0) throw new CannotRun("model.onnx has no tapml.program metadata: it was not written by tapml");
  let depth = 0;
  for (let i = at; i < text.length; i++) {
    depth += text[i] === "{" ? 1 : text[i] === "}" ? -1 : 0;
    if (depth === 0) return JSON.parse(text.slice(at, i + 1));
  }
  throw new CannotRun("model.onnx's tapml.program metadata is cut short");
}

function typedInput(dtype, npy) {
  const kinds = { "<f4": Float32Array, "<f2": Uint16Array, "<f8": Float64Array, "<i8": BigInt64Array, "<i4": Int32Array,
                  "<i2": Int16Array, "|i1": Int8Array, "|u1": Uint8Array, "|b1": Uint8Array };
  const Typed = kinds[npy.descr];
  if (!Typed || NPY_OF[dtype] !== npy.descr) throw new CannotRun(`an input of dtype ${dtype} is stored as ${npy.descr}`);
  return new Typed(npy.data);
}

async function reproduce(read) {
  const plan = JSON.parse(new TextDecoder().decode(await read("plan.json")));
  if (plan.format !== "tapml-backend-repro/1") throw new CannotRun("plan.json is not a tapml-backend-repro/1 plan");
  const provider = new URL(location.href).searchParams.get("provider") || String(plan.target).split(":")[1] || "webgpu";
  const ort = await loadOrt();
  let adapter = "CPU (onnxruntime-web wasm)", info = {};
  if (provider === "webgpu") {
    if (!navigator.gpu) throw new CannotRun("navigator.gpu is missing: this browser has no WebGPU here");
    const gpu = await navigator.gpu.requestAdapter();
    if (!gpu) throw new CannotRun("navigator.gpu.requestAdapter() returned no adapter");
    info = gpu.info ?? {};
    adapter = [info.vendor, info.architecture, info.device, info.description].filter((x) => x).join(" ") || "WebGPU adapter";
    ort.env.webgpu.adapter = gpu;
  }
  const said = [];
  const original = console.error.bind(console);
  console.error = (...args) => { said.push(args.map(String).join(" ")); original(...args); };
  const model = new Uint8Array(await read(plan.artifact));
  const session = await ort.InferenceSession.create(model, { executionProviders: [provider] });
  const signature = signatureOf(model);
  const feeds = {};
  for (const [i, input] of plan.inputs.entries()) {
    const name = signature.inputs[i];
    if (!session.inputNames.includes(name)) continue; // an input the exporter dropped
    const npy = parseNpy(await read(input.file), input.file);
    feeds[name] = new ort.Tensor(input.dtype, typedInput(input.dtype, npy), input.shape);
  }
  const outputs = await session.run(feeds);
  const gpuErrors = said.filter((line) => line.includes("WebGPU validation error"));
  let result, status;
  if (gpuErrors.length) {
    status = "error";
    result = { passed: false, max_abs_err: null, max_rel_err: null, mismatch_fraction: null, worst: [],
               message: `WebGPU rejected onnxruntime-web's kernel, so its outputs were never written: ${gpuErrors[0]}` };
  } else {
    const results = [];
    for (const [i, out] of plan.outputs.entries()) {
      const tensor = outputs[session.outputNames[i]];
      const dims = [...tensor.dims];
      if (tensor.type !== out.dtype || dims.join() !== out.shape.join()) {
        results.push({ passed: false, max_abs_err: null, max_rel_err: null, mismatch_fraction: null, worst: [],
                       message: `output ${tensor.type} [${dims}] != reference ${out.dtype} [${out.shape}]` });
        continue;
      }
      const count = dims.reduce((a, b) => a * b, 1);
      const data = tensor.data;
      const got = count ? numbers(NPY_OF[tensor.type], data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength), count) : [];
      const npy = parseNpy(await read(out.expected), out.expected);
      const want = count ? numbers(npy.descr, npy.data, count) : [];
      results.push(compare(got, want, out.shape, out.dtype, out.rtol, out.atol));
    }
    result = merge(results);
    status = result.passed ? "pass" : "mismatch";
  }
  showVerdict(plan, status, result, `${adapter} (onnxruntime-web ${ort.env.versions?.web ?? ORT_WEB_VERSION}, ${provider})`, info);
}

startPage(reproduce);
