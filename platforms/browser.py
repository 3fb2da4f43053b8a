"""The ``browser`` target: WebGPU in a real browser page, driven over a WebSocket.

tapml serves a page (``platforms/web/index.html`` + ``runtime.js``, plain ES modules) and a
WebSocket endpoint from a background thread. The page opens the browser's WebGPU device,
reports its adapter, features and limits, and then executes the KernelPrograms the host
compiles (:func:`tapml.platforms.wgsl.compile_graph`). Tensors travel as binary frames with
a 16-byte header (``TPT1``, run id, slot, kind) holding device bytes (int64 already lowered
to i32, bool to u32 on the host), never as JSON arrays.

``BrowserPlatform()`` starts the system Chromium headless with a fresh profile and closes it
(process group and all) on :meth:`close`, at exit, or when tapml dies. ``BrowserPlatform(
launch=False)`` starts no browser: whoever opens :attr:`BrowserPlatform.url` (a one-time
token) in a WebGPU browser becomes the device. When that page is lost (tab closed, GPU
device lost, no answer), a fresh one-time URL is handed out and the next page to open it
becomes the device; runs in between raise DeviceLost.

This module is the platform (a :class:`~tapml.platforms.wgsl_platform.WgslPlatform` runtime:
``_prepare`` makes a program's plan, ``_execute`` ships it with its first run on a page); the
page bridge and frame codec are :mod:`tapml.platforms.page_bridge`, the Chromium launcher
:mod:`tapml.platforms.chromium` (the token never appears on a command line).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable

from tapml.errors import DeviceLost, PlatformError, TapmlError
from tapml.platforms.base import KernelProgram, ResidentTensor
from tapml.platforms.chromium import INSTALL_HINT, ChromiumProcess, find_chromium
from tapml.platforms.page_bridge import KIND_CONST, KIND_INPUT, PageBridge, encode_frame
from tapml.platforms.program_cache import ProgramCache
from tapml.platforms.wgsl.registry import low_precision_paths
from tapml.platforms.wgsl_platform import WgslPlatform


class BrowserPlatform(WgslPlatform):
    """WebGPU in a browser page. ``launch=True`` starts headless Chromium on :attr:`url` and waits
    for its adapter; ``launch=False`` waits (on first use, or :meth:`wait_for_device`) for a person
    to open :attr:`url` in any WebGPU browser, and when that page is lost, hands a fresh URL to
    ``on_url`` (default: prints it) for another page to take its place.

    Example::

        with BrowserPlatform() as browser:
            outputs = browser.run(browser.compile(graph), inputs)
    """

    name = "browser"

    def __init__(self, launch: bool = True, host: str = "127.0.0.1", port: int = 0, *,
                 connect_timeout: float | None = None, run_timeout: float = 300.0, chromium: str | None = None,
                 chromium_flags: tuple[str, ...] = (), on_url: Callable[[str], None] | None = None):
        self.launch = launch
        self.chromium_flags = tuple(chromium_flags)
        self.run_timeout = run_timeout
        self.connect_timeout = connect_timeout or (90.0 if launch else 600.0)
        self.browser: ChromiumProcess | None = None
        self._closed = False
        self._run_id = 0
        self.guards = False
        super().__init__()  # self.programs: each program's plan for the page and its const bytes
        # the program keys the page of self._page has prepared, kept to the same limits as the
        # page's own cache (it evicts alike; a program it dropped anyway is sent again)
        self._on_page = ProgramCache(self.programs.max_entries, self.programs.max_bytes, on_evict=self._page_dropped)
        # what the page holds for each program on it: its input tensors, by input name, as
        # (tensor, _version) of what was last sent (weights cross once), and the outputs kept
        # there for later runs ((program key, output position) -> output buffer name)
        self._page_inputs: dict[str, dict[str, tuple]] = {}
        self._kept: dict[tuple[str, int], tuple[str, str]] = {}  # -> (buffer name, WGSL dtype)
        self._page: concurrent.futures.Future | None = None
        #: runs that found their program dropped from the page's cache (it was sent again)
        self.page_misses = 0
        self._hello: dict | None = None  # the last page's hello (its caps stay valid while a new page is awaited)
        executable = find_chromium() if launch and not chromium else chromium
        self._executable = executable
        self.relaunches = 0
        self.bridge = PageBridge(host, port, rejoin=not launch, on_url=on_url or _print_new_url,
                                 program_cache=self._page_cache_limits())
        if launch:
            try:
                # started from the bridge thread so that the parent-death signal follows the platform's life
                self.browser = self.bridge.call_soon(self._launch(executable)).result(timeout=30)
                self.wait_for_device()
            except BaseException:
                self.close()
                raise

    @property
    def url(self) -> str:
        """The page URL to open (with ``launch=False``, a fresh one after each lost page)."""
        return self.bridge.url

    def reconnect(self) -> None:
        """Start a fresh browser and page after a crash. With ``launch=False`` a person opens the
        new URL instead: this returns when a page has attached again, else raises DeviceLost."""
        if self._closed:
            raise DeviceLost("the browser platform was closed")
        if not self.launch:
            if self.bridge.lost:
                raise DeviceLost(self.bridge.lost)
            return
        if self.browser is not None:
            self.browser.close()
        self.bridge.close()
        self.bridge = PageBridge(self.bridge.host, 0, program_cache=self._page_cache_limits())
        try:
            self.browser = self.bridge.call_soon(self._launch(self._executable)).result(timeout=30)
            self.wait_for_device()
        except TapmlError as e:
            raise DeviceLost(f"a fresh browser did not come up: {e}") from None
        self.relaunches += 1

    async def _launch(self, executable):
        return ChromiumProcess(self.url, executable, self.chromium_flags)

    def _alive(self) -> str | None:
        return self.browser.exited() if self.browser is not None else None

    def _crash_reason(self) -> str | None:
        """How the launched browser ended, when it did (it may exit just after its socket closes)."""
        if self.browser is None:
            return None
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            reason = self.browser.exited()
            if reason:
                return reason
            time.sleep(0.05)
        return None

    def wait_for_device(self, timeout: float | None = None) -> dict:
        """Block until the page has reported its adapter; returns its hello message.

        Raises TapmlError when the browser has no WebGPU adapter or never connects."""
        timeout = timeout or self.connect_timeout
        try:
            hello = self.bridge.wait(self.bridge.hello, timeout, "waiting for the page to open WebGPU", self._alive)
        except DeviceLost as e:
            tail = self.browser.log_tail() if self.browser else ""
            raise TapmlError(f"the browser page never reported a WebGPU adapter ({e}); check that Chromium starts "
                             f"headless here; {INSTALL_HINT}" + (f"\nchromium said:\n{tail}" if tail else "")) from None
        if hello.get("error"):
            self.close()
            if "secure context" in hello["error"]:
                hint = (f"or let the browser treat {self.url.split('/t/')[0]} as secure "
                        f"(chrome://flags/#unsafely-treat-insecure-origin-as-secure)")
            else:
                hint = ("install Vulkan drivers (Debian: `apt-get install mesa-vulkan-drivers`) or use a browser "
                        "with WebGPU (Chromium with --enable-unsafe-webgpu, recent Chrome, Edge, Safari)")
            raise TapmlError(f"the browser has no WebGPU adapter: {hello['error']}; {hint}")
        self._hello = hello
        return hello

    def _caps(self) -> dict:
        page = self.bridge.hello
        attached = page.done() and page.exception() is None
        hello = self.wait_for_device() if attached or self._hello is None else self._hello
        info = hello.get("adapter") or {}
        adapter = " ".join(x for x in (info.get("vendor"), info.get("architecture")) if x) or "unknown"
        if info.get("description"):
            adapter += f" ({info['description']})"
        features = list(hello.get("features") or [])
        dtypes = ["float32", "float16", "bfloat16", "int32", "int64", "int16", "int8", "uint8", "uint64", "bool"]
        cpu = "swiftshader" in adapter.lower()  # Chromium's software adapter
        return {"adapter": adapter, "backend": "browser-webgpu", "cpu_adapter": cpu, "browser": hello.get("userAgent", ""),
                "adapter_info": info, "features": features, "limits": dict(hello.get("limits") or {}),
                "dtypes": dtypes, "low_precision": low_precision_paths(features), "url": self.url}

    def enable_guards(self) -> bool:
        """Guard every buffer a kernel writes, as :meth:`WgpuPlatform.enable_guards` does, in the
        page (``platforms/web/runtime.js``): programs are sent to the page again with guards."""
        if not self.guards:
            self.guards = True
            self.programs.clear()
            self._on_page.clear()
        return True

    def _page_cache_limits(self) -> dict:
        return {"max_programs": self.programs.max_entries, "max_bytes": self.programs.max_bytes}

    def _prepare(self, program: KernelProgram) -> tuple[dict, list[bytes], set[str]]:
        """The page's view of a program (buffer sizes, const names, kernels), the const bytes and
        the buffers its kernels write; the page itself gets it with the program's first run there."""
        consts = [b for b in program.buffers if b.role == "const"]
        plan = {"buffers": [{"name": b.name, "size": b.size} for b in program.buffers],
                "consts": [b.name for b in consts],
                "poison": [b.name for b in program.buffers if b.role == "output" and b.size],
                "kernels": [k.to_json() for k in program.kernels]}
        written = {name for k in program.kernels for name, access, *_ in k.bindings if access == "read_write"}
        if self.guards:  # see enable_guards; the page sizes, fills and checks them (runtime.js)
            limits = self.caps()["limits"]
            room = min(limits.get("max-storage-buffer-binding-size", 128 << 20), limits.get("max-buffer-size", 256 << 20))
            plan["guards"] = {b.name: -(-b.size // 4) * 4 for b in program.buffers
                              if b.name in written and b.role != "const" and b.size and -(-b.size // 4) * 4 + 256 <= room}
        data = [b.data or b"" for b in consts]
        return (plan, data, written), sum(len(d) for d in data)

    def _page_dropped(self, key: str, _value=None) -> None:
        """The page no longer holds program ``key`` (evicted, failed, or a new page): forget its
        inputs and the outputs it kept."""
        self._page_inputs.pop(key, None)
        for k in [k for k in self._kept if k[0] == key]:
            del self._kept[k]

    def _execute(self, program: KernelProgram, prepared, inputs: list) -> list:
        return self._run_on_page(program, prepared, inputs, ())

    def _run_resident(self, program: KernelProgram, inputs: list, keep: list[int]) -> list:
        """Resident inputs are copied on the page from the output buffer that holds them into
        this program's input buffer; kept outputs stay in their buffers on the page, unread."""
        return self._run_on_page(program, self.prepared(program), inputs, keep)

    def _new_page(self) -> None:
        if self._closed:
            raise DeviceLost("the browser platform was closed")
        if self.bridge.hello is not self._page:  # one hello future per page: a new page has no programs yet
            self._page = self.bridge.hello
            self._on_page.clear()

    def _run_on_page(self, program: KernelProgram, prepared, inputs: list, keep) -> list:
        from tapml.platforms.wgsl.codegen import ITEMSIZE
        from tapml.platforms.wgsl.tensors import read_output, to_device
        self._new_page()
        specs = {b.name: b for b in program.buffers}
        metas = program.output_meta or [specs[n].meta for n in program.outputs]
        keep = set(keep)
        outputs = [[name, meta.numel * ITEMSIZE[specs[name].dtype]]
                   for i, (name, meta) in enumerate(zip(program.outputs, metas)) if i not in keep]
        copies = []  # [input buffer, program key holding the tensor, its buffer, bytes]
        for i, (name, t) in enumerate(zip(program.inputs, inputs)):
            if isinstance(t, ResidentTensor):
                src = self._kept.get((t.program, t.output))
                if src is None or t.program not in self._on_page:
                    raise PlatformError(f"input {i}: the browser page no longer holds that resident tensor (the page "
                                        "was replaced, or it dropped the program that made it: raise "
                                        "TAPML_PROGRAM_CACHE); run again from the step that made it")
                self._on_page.get(t.program)  # just used: the page keeps it while this program is prepared
                copies.append([name, t.program, src[0], max(4, -(-specs[name].size // 4) * 4)])
        plan, consts, written = prepared
        payloads: dict[str, bytes] = {}
        for attempt in range(2):
            send_program = program.key not in self._on_page
            if send_program:
                self._page_dropped(program.key)  # prepared afresh on the page: it holds none of its inputs
            held = self._page_inputs.get(program.key, {})
            send, kept_inputs = [], []
            for name, t in zip(program.inputs, inputs):
                if isinstance(t, ResidentTensor):
                    continue
                last = held.get(name)
                if last is not None and last[0] is t and last[1] == t._version and name not in written:
                    kept_inputs.append(name)  # the page's buffer already holds this very tensor
                    continue
                if name not in payloads:
                    payloads[name] = to_device(t, specs[name].dtype, f"input {name}")
                send.append((name, t))
            self._run_id += 1
            msg = {"type": "run", "id": self._run_id, "key": program.key, "program": plan if send_program else None,
                   "inputs": [name for name, _ in send], "held": kept_inputs, "copies": copies, "outputs": outputs}
            frames = ([encode_frame(self._run_id, i, KIND_CONST, c) for i, c in enumerate(consts)] if send_program
                      else [])
            frames += [encode_frame(self._run_id, i, KIND_INPUT, payloads[name]) for i, (name, _) in enumerate(send)]
            try:
                reply, got = self.bridge.request(msg, frames, self.run_timeout, self._alive)
            except DeviceLost as e:
                raise DeviceLost(self._crash_reason() or str(e)) from None
            self.upload_bytes += sum(len(payloads[name]) for name, _ in send) + (sum(map(len, consts)) if send_program else 0)
            if reply["type"] == "done":
                self._on_page.put(program.key, True, sum(b["size"] for b in plan["buffers"]))
                held = self._page_inputs.setdefault(program.key, held)
                held.update({name: (t, t._version) for name, t in send})
                for name, *_ in copies:
                    held.pop(name, None)
                for i in range(len(program.outputs)):
                    if i in keep:
                        self._kept[(program.key, i)] = (program.outputs[i], specs[program.outputs[i]].dtype)
                    else:
                        self._kept.pop((program.key, i), None)
                break
            # a failed run leaves the program's buffers unknown: nothing of it is relied on again
            self._page_dropped(program.key)
            if reply.get("code") in ("no-program", "no-input") and attempt == 0:
                self._on_page.pop(program.key)
                self.page_misses += 1
                continue
            if reply.get("code") == "no-resident":
                raise PlatformError(f"browser: the page dropped the program holding a resident input "
                                    f"({reply.get('message', '')}); raise TAPML_PROGRAM_CACHE")
            raise PlatformError(f"browser: {reply.get('message', 'run failed')}")
        if len(got) != len(outputs):
            raise PlatformError(f"the browser returned {len(got)} of {len(outputs)} outputs")
        read = iter(range(len(outputs)))
        return [None if i in keep else read_output(got[next(read)], specs[name].dtype, meta, name)
                for i, (name, meta) in enumerate(zip(program.outputs, metas))]

    def _read_resident(self, handle):
        from tapml.platforms.wgsl.codegen import ITEMSIZE
        from tapml.platforms.wgsl.tensors import read_output
        self._new_page()
        kept = self._kept.get((handle.program, handle.output))
        if kept is None or handle.program not in self._on_page:
            raise PlatformError("the browser page no longer holds that resident tensor (the page was replaced, or "
                                "it dropped the program that made it: raise TAPML_PROGRAM_CACHE)")
        name, dtype = kept
        self._run_id += 1
        nbytes = handle.meta.numel * ITEMSIZE[dtype]
        msg = {"type": "read", "id": self._run_id, "key": handle.program, "outputs": [[name, nbytes]]}
        try:
            reply, got = self.bridge.request(msg, [], self.run_timeout, self._alive)
        except DeviceLost as e:
            raise DeviceLost(self._crash_reason() or str(e)) from None
        if reply["type"] != "done" or len(got) != 1:
            self._page_dropped(handle.program)
            raise PlatformError(f"browser: reading a resident tensor failed: {reply.get('message', 'no data')}")
        return read_output(got[0], dtype, handle.meta, name)

    def close(self) -> None:
        """Close the browser (if tapml launched it) and the server. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        super().close()
        if self.browser is not None:
            self.browser.close()
        self.bridge.close()


def _print_new_url(url: str) -> None:
    print(f"the browser page is gone; open {url} in a browser with WebGPU to attach another", flush=True)


__all__ = ["BrowserPlatform"]
