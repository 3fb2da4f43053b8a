// What every tapml repro page shares (a classic script, loaded before the page's runner: Chromium refuses
// module scripts from file://): the folder's files, fetched next to the page or picked by a person, .npy
// parsing, and tapml's comparison rule with the stats run.py prints. plan.json is data: it may name only
// plain file names of this folder, and nothing from it is ever run or put into the page as HTML.

const FILE_NAME = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,120}$/;
const WORST = 5;

class CannotRun extends Error {}

const show = (id, text) => { document.getElementById(id).textContent = text; };

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
    // int64 stays exact as BigInt (i64: the two-word int64 of values past i32, low word first)
    case "<i8": case "i64": return Array.from(new BigInt64Array(data, 0, count));
    case "<u8": case "u64": return Array.from(new BigUint64Array(data, 0, count));
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
      const d = BigInt(a) - BigInt(b);
      diff[i] = Math.abs(Number(d));
      rel[i] = diff[i] / Math.max(Math.abs(Number(b)), 1e-300);
      bad[i] = d !== 0n ? 1 : 0;
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
  const fmt = (v) => (typeof v === "bigint" ? (Number.isSafeInteger(Number(v)) ? Number(v) : String(v))
    : Number.isFinite(v) ? v : String(v));
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

/** Puts the verdict into #result (PASS or FAIL, the stats) and #details (the worst elements, what tapml saw). */
function showVerdict(plan, status, result, adapter, info) {
  const fmt = (x) => (x === null ? "-" : Number(x).toPrecision(6));
  const subject = plan.subject ?? {};
  const title = subject.kind ? `${subject.kind} ${subject.label ?? ""}` : String(plan.title ?? "");
  show("result", `${status === "pass" ? "PASS" : "FAIL"} ${status}: ${title} on ${adapter}\n` +
                 `max_abs_err ${fmt(result.max_abs_err)}  max_rel_err ${fmt(result.max_rel_err)}  ` +
                 `mismatch_fraction ${fmt(result.mismatch_fraction)}`);
  const seen = plan.observed ?? {};
  show("details", [result.message, ...result.worst.map((w) => `at [${w.index}]: got ${w.target}, expected ${w.reference}`),
                   `tapml saw on ${plan.target}: ${seen.status}, max_abs_err ${fmt(seen.max_abs_err ?? null)}`,
                   `result as JSON: ${JSON.stringify({ status, ...result, adapter: info })}`].filter((x) => x).join("\n"));
}

/** Runs ``reproduce(read)`` on the folder's files: fetched when the page is served, else the ones a person picks. */
async function startPage(reproduce) {
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
