"""ONNX Runtime Web as a compiler under test: the ``ort-web:webgpu`` and ``ort-web:wasm`` TARGETs.

The route: the ExportedProgram -> torch's ONNX exporter (:mod:`tapml.platforms.onnx_route`, as for
``ort``) -> ONNX bytes -> onnxruntime-web (the npm package, pinned in ``platforms/web/ort/package.json``
and installed there by the README's setup) in a headless Chromium, on its WebGPU provider or its
WebAssembly CPU provider. The page (``platforms/web/ort.html`` + ``ort_runtime.js``) and onnxruntime-web's
own files are served from loopback by the ``browser`` target's :class:`~tapml.platforms.page_bridge.PageBridge`,
with the same one-time token and Origin check; the page fetches nothing from anywhere else.

What crosses to the page: each program's ONNX bytes once (the page keeps a session per program, the
least recently used of :data:`MAX_SESSIONS` released first), and each input tensor once per content --
the page holds the tensors it was sent by digest, so a model's weights, the same in every run of every
program, cross the socket once. onnxruntime-web copies them to the GPU on each run (its CPU tensors).

``control = "ort"``: ONNX Runtime's CPU provider runs the same ONNX natively, so a case that fails
here and passes there is onnxruntime-web's (its WebGPU kernels, or its wasm build); one that fails in
both is the exporter's. When Chromium dies (killed, or its GPU process crashed), the run is tried once
more on a fresh Chromium; a second death is the case's ``error`` verdict.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from tapml.errors import DeviceLost, TapmlError
from tapml.platforms.backend import Backend, BackendRefused, Compiled
from tapml.platforms.onnx_route import feed_names, node_types, onnx_model, opset, read_signature, refuse_dtypes
from tapml.platforms.page_bridge import HTML, JS, KIND_CONST, KIND_INPUT, WASM, WEB_DIR, encode_frame

#: The files of onnxruntime-web the page loads (its ES module, and the WebAssembly build with the WebGPU
#: provider): nothing else of the package is served.
ORT_WEB_FILES = ("ort.min.mjs", "ort-wasm-simd-threaded.jsep.mjs", "ort-wasm-simd-threaded.jsep.wasm")
#: Sessions the page keeps (one per program); the least recently used is released first.
MAX_SESSIONS = 64
INSTALL_HINT = ("run the README's setup (`make setup`; it runs `npm ci` in platforms/web/ort), or point $TAPML_ORT_WEB "
                "at an onnxruntime-web package folder")

#: torch dtype -> onnxruntime-web's tensor type name.
WEB_TYPES = {torch.float32: "float32", torch.float16: "float16", torch.float64: "float64", torch.int64: "int64",
             torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}
TORCH_TYPES = {name: dtype for dtype, name in WEB_TYPES.items()} | {"uint16": torch.uint16, "uint32": torch.uint32}


def ort_web_package() -> Path:
    """The onnxruntime-web package folder to serve; BackendRefused saying how to install it when it is missing."""
    from tapml.platforms.targets import ort_web_folder
    folder = ort_web_folder()
    missing = [name for name in ORT_WEB_FILES if not (folder / "dist" / name).is_file()]
    if missing:
        raise BackendRefused(f"onnxruntime-web is not installed (no {folder / 'dist' / missing[0]}): {INSTALL_HINT}")
    return folder


def ort_web_version(folder: Path) -> str:
    """The version of the onnxruntime-web package in ``folder`` (its package.json)."""
    try:
        version = json.loads((folder / "package.json").read_text()).get("version")
    except (OSError, ValueError):
        version = None
    return version if isinstance(version, str) else "unknown"


def page_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """What the page bridge serves for an ort-web page: the page, its two modules, onnxruntime-web's files."""
    files = {"": (WEB_DIR / "ort.html", HTML), "index.html": (WEB_DIR / "ort.html", HTML),
             "ort_runtime.js": (WEB_DIR / "ort_runtime.js", JS), "frames.js": (WEB_DIR / "frames.js", JS)}
    for name in ORT_WEB_FILES:
        files[f"ort/{name}"] = (folder / "dist" / name, WASM if name.endswith(".wasm") else JS)
    return files


@dataclass
class OrtWebProgram:
    """A program whose session the page creates from its ONNX bytes (``key``: their digest):
    ``inputs`` is the session input fed from each program input (None where the exporter dropped one)."""

    key: str
    inputs: list[str | None]
    outputs: int


_KERNEL_REFUSED = re.compile(r'ShaderModuleDescriptor ""?([^"\]]+)')
_KERNEL_INVALID = re.compile(r'Invalid (?:ComputePipeline|ShaderModule) "([^"]+)"')


def gpu_errors(reply: dict, first_seen: dict[str, str]) -> str | None:
    """What WebGPU said when it rejected onnxruntime-web's own work during a job (a shader that does not
    validate, a pipeline built on it), else None: the run then "succeeds" with outputs nothing wrote.

    WebGPU names the reason once, when the shader is created; a later run of the same cached pipeline only
    hears that it is invalid. ``first_seen`` (kernel label -> reason, kept by the caller) carries the reason
    to those runs."""
    said = reply.get("said")
    errors = [" ".join(line.replace("An uncaught WebGPU validation error was raised:", "").split())
              for line in said if isinstance(line, str) and "WebGPU validation error" in line] \
        if isinstance(said, list) else []
    if not errors:
        return None
    for error in errors:
        refused = _KERNEL_REFUSED.search(error)
        if refused and refused.group(1) not in first_seen:
            first_seen[refused.group(1)] = error.split(" - While")[0]
    label = next((m.group(1) for m in map(_KERNEL_REFUSED.search, errors) if m), None) or \
        next((m.group(1) for m in map(_KERNEL_INVALID.search, errors) if m), None)
    reason = first_seen.get(label) if label else None
    kernel = f"{label} kernel" if label else "kernel"
    return (f"WebGPU rejected onnxruntime-web's {kernel}, so its outputs were never written: "
            f"{reason or errors[0].split(' - While')[0]}")


class OrtWebBackend(Backend):
    """onnxruntime-web in headless Chromium, on its WebGPU provider (``ort-web:webgpu``) or its
    WebAssembly one (``ort-web:wasm``). One Chromium per backend, started when it opens."""

    forms = ("ort-web:webgpu", "ort-web:wasm")
    needs = ("onnxruntime-web (npm; the README's setup installs it into platforms/web/ort), Chromium, "
             "and onnx + onnxscript: pip install 'tapml[backends]'")
    control = "ort"  # the same ONNX on ONNX Runtime's native CPU provider
    #: seconds to wait for the page to start onnxruntime-web, and for one load or run
    start_timeout = 90.0
    run_timeout = 300.0

    def __init__(self, spec: str):
        super().__init__(spec)
        self.provider = spec.partition(":")[2] or "webgpu"
        if self.provider not in ("webgpu", "wasm"):
            raise BackendRefused(f"unknown target {spec!r}; ort-web takes: {', '.join(self.forms)}")
        self.package = ort_web_package()
        self.version = ort_web_version(self.package)
        self._files = page_files(self.package)
        self._models: dict[str, bytes] = {}  # key -> ONNX bytes, to create its session again on a fresh page
        self._sessions: OrderedDict[str, None] = OrderedDict()  # keys the current page holds a session for
        self._sent: set[str] = set()  # digests of the inputs the current page holds
        self._run_id = 0
        self._shader_errors: dict[str, str] = {}  # kernel label -> why WebGPU first refused its shader
        self.bridge = self.browser = None
        self.hello: dict = {}
        self.relaunches = 0
        #: bytes of input tensors sent to the page so far (a tensor the page holds is not sent again)
        self.sent_bytes = 0
        self._start()

    def _start(self) -> None:
        from tapml.platforms.chromium import ChromiumProcess, find_chromium
        from tapml.platforms.page_bridge import PageBridge
        self._sessions.clear()
        self._sent.clear()
        try:
            executable = find_chromium()
        except TapmlError as e:
            raise BackendRefused(str(e)) from None
        self.bridge = PageBridge(files=self._files)
        url = f"{self.bridge.url}?provider={self.provider}"

        async def launch():  # from the bridge's thread, so that Chromium dies with it (see ChromiumProcess)
            return ChromiumProcess(url, executable)
        self.browser = self.bridge.call_soon(launch()).result(timeout=30)
        try:
            hello = self.bridge.wait(self.bridge.hello, self.start_timeout, "starting onnxruntime-web", self._alive)
        except DeviceLost as e:
            tail = self.browser.log_tail()
            self.close()
            raise BackendRefused(f"the ort-web page never started ({e})" + (f"; chromium said: {tail}" if tail else "")) \
                from None
        if hello.get("error"):
            self.close()
            raise BackendRefused(f"onnxruntime-web cannot start on {self.provider} in this Chromium: {hello['error']}")
        self.hello = hello

    def _alive(self) -> str | None:
        return self.browser.exited() if self.browser is not None else None

    def _restart(self) -> None:
        self.close()
        self._start()
        self.relaunches += 1

    def describe(self) -> dict:
        import onnx
        import onnxscript
        adapter = self.hello.get("adapter") or {}
        where = " ".join(str(adapter.get(k) or "") for k in ("vendor", "architecture", "description")).strip()
        device = (f"{where or 'WebGPU adapter'} (onnxruntime-web webgpu in Chromium)" if self.provider == "webgpu"
                  else "CPU (onnxruntime-web wasm in Chromium)")
        return {"device": device, "provider": self.provider, "adapter": adapter, "features": self.hello.get("features", []),
                "onnxruntime_web": self.version, "user_agent": self.hello.get("userAgent", ""),
                "onnx": onnx.__version__, "onnxscript": onnxscript.__version__, "opset": opset(),
                "route": "torch.onnx exporter (dynamo) -> ONNX -> onnxruntime-web in headless Chromium",
                "version": f"onnxruntime-web {self.version} ({self.provider}), torch {torch.__version__}, "
                           f"onnxscript {onnxscript.__version__}, opset {opset()}"}

    def refuse(self, program) -> str | None:
        return refuse_dtypes(program) or refuse_dtypes(program, WEB_TYPES, "onnxruntime-web")

    def compile(self, program) -> Compiled:
        model, signature = onnx_model(program)
        return Compiled(handle=self._program(model, signature), artifact=model, artifact_name="model.onnx", blob=model)

    def load(self, blob: bytes) -> OrtWebProgram:
        """A session on the page from the ONNX bytes :meth:`compile` made (its signature in the model's metadata)."""
        return self._program(blob, read_signature(blob))

    def _program(self, model: bytes, signature: dict) -> OrtWebProgram:
        key = hashlib.sha256(model).hexdigest()[:32]
        self._models[key] = model
        reply = self._attempt(lambda: self._load(key))
        return OrtWebProgram(key, feed_names(signature, reply["inputs"], len(reply["outputs"])), signature["outputs"])

    def _attempt(self, step):
        """``step()``, once more on a fresh Chromium when the browser died during it."""
        for attempt in range(2):
            try:
                if self.bridge is None or self.bridge.lost:
                    self._restart()
                return step()
            except DeviceLost as e:
                if attempt:
                    raise RuntimeError(f"Chromium died twice running this program ({self._alive() or e})") from None
                self.bridge.mark_lost(str(e))

    def _request(self, msg: dict, frames: list[bytes]) -> tuple[dict, dict[int, bytes]]:
        self._run_id += 1
        return self.bridge.request({**msg, "id": self._run_id}, [f(self._run_id) for f in frames], self.run_timeout,
                                   self._alive)

    def _load(self, key: str) -> dict:
        model = self._models[key]
        reply, _ = self._request({"type": "load", "key": key}, [lambda run: encode_frame(run, 0, KIND_CONST, model)])
        if reply["type"] != "done":
            raise BackendRefused(f"onnxruntime-web ({self.provider}) could not create a session: {reply.get('message', '')}")
        elsewhere = self._elsewhere(model, reply.get("placement"), reply.get("to_cpu"))
        if elsewhere:
            self.bridge.post({"type": "drop", "key": key})
            raise BackendRefused(f"onnxruntime-web did not put the program on {self.provider} as asked (it falls back "
                                 f"silently): {', '.join(elsewhere[:5])}{f' and {len(elsewhere) - 5} more' if len(elsewhere) > 5 else ''} "
                                 "on its CPU (wasm) provider")
        self._sessions[key] = None
        while len(self._sessions) > MAX_SESSIONS:
            old, _ = self._sessions.popitem(last=False)
            self.bridge.post({"type": "drop", "key": old})
        if not (isinstance(reply.get("inputs"), list) and isinstance(reply.get("outputs"), list)):
            raise RuntimeError("the ort-web page answered a load without its session's inputs and outputs")
        return reply

    def _elsewhere(self, model: bytes, placement, to_cpu) -> list[str]:
        """The nodes on floating-point data that ONNX Runtime placed on another provider than the one asked for
        (``webgpu``'s is ``JsExecutionProvider``) because it could not take them: ``["Sin 'node_sin' (float16)"]``.

        Not the nodes it put on the CPU on purpose (small shape computations, logged as a forced fallback), nor
        nodes whose inputs are all integers or bools (a cast of positions to float included): onnxruntime-web's
        WebGPU provider runs little int64 (positions, indices, masks) and leaves such nodes to its CPU provider
        by design, as a deployed model runs them too. None on ``wasm``, where every node is on the CPU."""
        if self.provider != "webgpu" or not isinstance(placement, dict):
            return []
        chosen = {str(name) for name in to_cpu} if isinstance(to_cpu, list) else set()
        found = [re.fullmatch(r"(\S+) \((.*)\)", str(node)) for ep, nodes in placement.items()
                 if ep != "JsExecutionProvider" and isinstance(nodes, list) for node in nodes]
        found = [(m[1], m[2]) for m in found if m and m[2] not in chosen]
        if not found:
            return []
        types = node_types(model, [name for _, name in found])
        floats = ("float", "float16", "double", "bfloat16")
        return [f"{op} '{name}' ({', '.join(t for t in types[name][0] if t in floats)})"
                for op, name in found if name in types and any(t in floats for t in types[name][0])]

    def run(self, compiled: Compiled, inputs: list) -> list:
        program: OrtWebProgram = compiled.handle
        if len(inputs) != len(program.inputs):
            raise ValueError(f"{len(inputs)} inputs given; the program takes {len(program.inputs)}")
        feeds = []
        for name, t in zip(program.inputs, inputs):
            if name is None:
                continue
            if t.dtype not in WEB_TYPES:
                raise ValueError(f"input {name} is {t.dtype}, which onnxruntime-web carries no tensors of")
            data = t.detach().contiguous().view(-1).numpy().tobytes() if t.numel() else b""
            digest = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode() + data, digest_size=16).hexdigest()
            feeds.append({"name": name, "type": WEB_TYPES[t.dtype], "dims": list(t.shape), "digest": digest, "data": data})
        return self._attempt(lambda: self._run(program, feeds))

    def _run(self, program: OrtWebProgram, feeds: list[dict]) -> list:
        for retry in range(2):
            if program.key not in self._sessions:
                self._load(program.key)
            self._sessions.move_to_end(program.key)
            send = [f for f in feeds if f["digest"] not in self._sent]
            slots = {id(f): i for i, f in enumerate(send)}
            msg = {"type": "run", "key": program.key,
                   "inputs": [{k: f[k] for k in ("name", "type", "dims", "digest")} | {"slot": slots.get(id(f), -1)}
                              for f in feeds]}
            frames = [lambda run, i=i, f=f: encode_frame(run, i, KIND_INPUT, f["data"]) for i, f in enumerate(send)]
            reply, got = self._request(msg, frames)
            self._sent.update(f["digest"] for f in send)
            self.sent_bytes += sum(len(f["data"]) for f in send)
            if reply["type"] == "done":
                refused = gpu_errors(reply, self._shader_errors)
                if refused:
                    raise RuntimeError(refused)
                return self._outputs(program, reply, got)
            if reply.get("code") in ("no-input", "no-session") and not retry:  # the page let go of them: send again
                self._sent.clear()
                self._sessions.pop(program.key, None)
                continue
            raise RuntimeError(f"onnxruntime-web ({self.provider}): {reply.get('message', 'the run failed')}")
        raise RuntimeError("the ort-web page kept dropping what it was sent")

    def _outputs(self, program: OrtWebProgram, reply: dict, got: dict[int, bytes]) -> list:
        specs = reply.get("outputs")
        if not isinstance(specs, list) or len(specs) != program.outputs or len(got) != program.outputs:
            raise RuntimeError(f"onnxruntime-web returned {len(got)} outputs; the program has {program.outputs}")
        outputs = []
        for slot, spec in enumerate(specs):
            dtype = TORCH_TYPES.get(spec.get("type")) if isinstance(spec, dict) else None
            dims = spec.get("dims") if isinstance(spec, dict) else None
            if dtype is None or not (isinstance(dims, list) and all(isinstance(d, int) and d >= 0 for d in dims)):
                raise RuntimeError(f"onnxruntime-web returned output {slot} as {spec!r}, which tapml cannot read")
            payload = got[slot]
            count = 1
            for d in dims:
                count *= d
            if len(payload) != count * torch.empty((), dtype=dtype).element_size():
                raise RuntimeError(f"output {slot} came back with {len(payload)} bytes for {spec['type']} {dims}")
            flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8 if dtype == torch.bool else dtype) \
                if payload else torch.empty(0, dtype=dtype)
            outputs.append((flat.bool() if dtype == torch.bool else flat).reshape(dims))
        return outputs  # as onnxruntime-web made them: a changed dtype or shape is the comparison's finding

    def repro_page(self) -> dict[str, str]:
        """A page that runs a case's ``model.onnx`` with onnxruntime-web alone (this version, from the folder's
        ``ort/`` or jsDelivr), on the provider the case ran on, and compares its outputs with the reference."""
        return {"index.html": (WEB_DIR / "ort_repro.html").read_text(),
                "ort_web.js": (WEB_DIR / "ort_repro.js").read_text().replace("__ORT_WEB_VERSION__", self.version)}

    def close(self) -> None:
        if self.browser is not None:
            self.browser.close()
        if self.bridge is not None:
            self.bridge.close()


__all__ = ["MAX_SESSIONS", "ORT_WEB_FILES", "OrtWebBackend", "OrtWebProgram", "ort_web_package"]
