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

The token never appears on a command line: a launched Chromium opens a start file in its own
0700 profile directory that forwards it to the page URL (see :class:`ChromiumProcess`). The
WebSocket upgrade needs the token, an ``Origin`` that is the bridge's own http origin, and a
token that no page has used yet: one token, one connection.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import hmac
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from html import escape
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from tapml.errors import DeviceLost, PlatformError, TapmlError
from tapml.graph import Graph, Node
from tapml.platforms.base import KernelProgram, Platform, check_workgroups

WEB_DIR = Path(__file__).with_name("web")
FRAME = struct.Struct("<IIII")  # magic, run id, slot, kind
FRAME_MAGIC = 0x31545054  # b"TPT1" as little-endian u32
KIND_INPUT, KIND_CONST, KIND_OUTPUT = 0, 1, 2
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = (
    "--headless=new", "--no-sandbox", "--enable-unsafe-webgpu", "--enable-features=Vulkan", "--disable-quic",
    "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-extensions", "--disable-dev-shm-usage",
    "--mute-audio",
)
INSTALL_HINT = ("install Chromium (Debian/Ubuntu: `apt-get install chromium`; it brings SwiftShader Vulkan, "
                "so WebGPU works without a GPU) or point $TAPML_CHROMIUM at a Chromium/Chrome binary")
_STATIC = {"": ("index.html", "text/html; charset=utf-8"), "index.html": ("index.html", "text/html; charset=utf-8"),
           "runtime.js": ("runtime.js", "text/javascript; charset=utf-8")}


def find_chromium() -> str:
    """Path of the Chromium to launch: ``$TAPML_CHROMIUM`` or the first of chromium, chromium-browser,
    google-chrome on PATH. Raises TapmlError saying what to install when there is none."""
    explicit = os.environ.get("TAPML_CHROMIUM")
    if explicit:
        path = shutil.which(explicit)
        if not path:
            raise TapmlError(f"$TAPML_CHROMIUM={explicit!r} is not an executable; {INSTALL_HINT}")
        return path
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    raise TapmlError(f"target browser needs Chromium, and none is installed (looked for {', '.join(CHROMIUM_NAMES)} "
                     f"on PATH); {INSTALL_HINT}")


def encode_frame(run_id: int, slot: int, kind: int, payload: bytes) -> bytes:
    """A binary tensor frame: 16-byte header then the tensor's device bytes."""
    return FRAME.pack(FRAME_MAGIC, run_id, slot, kind) + payload


def decode_frame(data: bytes) -> tuple[int, int, int, bytes]:
    """``(run_id, slot, kind, payload)`` of a binary frame; ValueError for a frame without the header."""
    if len(data) < FRAME.size:
        raise ValueError(f"binary frame of {len(data)} bytes is shorter than its {FRAME.size}-byte header")
    magic, run_id, slot, kind = FRAME.unpack_from(data)
    if magic != FRAME_MAGIC:
        raise ValueError("binary frame without the TPT1 header")
    return run_id, slot, kind, bytes(data[FRAME.size:])


def _lan_address() -> str:
    """This machine's address on its default route (what another device on the network can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET address: nothing is sent, it only picks a route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def _origin_key(origin: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of an http origin, the default port filled in; None when it is not one."""
    try:
        parts = urlsplit(origin)
        port = parts.port or 80
    except ValueError:
        return None
    if parts.scheme != "http" or not parts.hostname or parts.path or parts.query or parts.username:
        return None
    return parts.scheme, parts.hostname.lower(), port


REJOIN_HINT = "; open the new page URL tapml printed to attach another browser"
# Largest frame the page may send: one output buffer (WebGPU caps storage buffers far below this).
MAX_FRAME = 1 << 30


class PageBridge:
    """Serves the runtime page and one WebSocket connection to it, from a background thread
    running its own asyncio loop. The calling thread talks to the page with :meth:`request`.

    The WebSocket upgrade is accepted once per token, and only with an ``Origin`` header that is
    the bridge's own http origin (see :meth:`origin_allowed`); the connection that took it is the
    page session, and any other connection is refused. With ``rejoin`` a lost page is not the
    end: the bridge takes a fresh one-time token, calls ``on_url(url)`` with the new page URL,
    and the next page to open it (and report a working adapter) is the device again.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, rejoin: bool = False,
                 on_url: Callable[[str], None] | None = None):
        self.host = host
        self.rejoin = rejoin
        self.on_url = on_url
        self.lost: str | None = None
        self.pages = 0  # pages that attached with a working adapter
        self._closing = False
        self._new_token()
        self._ws = None
        self._run: tuple[int, concurrent.futures.Future, dict] | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tapml-browser-bridge", daemon=True)
        self._thread.start()
        try:
            self._server = self.call_soon(self._serve(host, port)).result(timeout=10)
        except OSError as e:
            self.close()
            raise TapmlError(f"cannot serve the browser page on {host}:{port}: {e.strerror or e}; "
                             f"choose another --port or host") from None
        self.port = self._server.sockets[0].getsockname()[1]

    def _new_token(self) -> None:
        """A fresh one-time URL, and a fresh ``hello`` future for the page that opens it."""
        self.token = secrets.token_urlsafe(18)
        self._token_used = False
        self._session = None  # the one connection that joined with this token
        self.hello: concurrent.futures.Future = concurrent.futures.Future()

    @property
    def url(self) -> str:
        """Where the page lives; the path carries the one-time token."""
        host = self.host
        if host in ("0.0.0.0", "", "::"):
            host = _lan_address()
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/t/{self.token}/"

    def call_soon(self, coro) -> concurrent.futures.Future:
        """Run ``coro`` on the bridge's loop; returns a future the calling thread can wait on."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _serve(self, host, port):
        from websockets.asyncio.server import serve
        return await serve(self._handler, host, port, process_request=self._process_request, compression=None,
                           max_size=MAX_FRAME, ping_interval=20, ping_timeout=60, open_timeout=20)

    def _process_request(self, connection, request):
        from websockets.datastructures import Headers
        from websockets.http11 import Response

        def respond(status: int, reason: str, body: bytes, ctype: str = "text/plain; charset=utf-8"):
            headers = Headers([("Content-Type", ctype), ("Content-Length", str(len(body))),
                               ("Cache-Control", "no-store"), ("Connection", "close")])
            return Response(status, reason, headers, body)

        path = request.path.split("?", 1)[0]
        parts = path.strip("/").split("/")
        if len(parts) < 2 or parts[0] != "t":
            return respond(404, "Not Found", b"not a tapml page; open the exact URL tapml printed\n")
        if not hmac.compare_digest(parts[1].encode(), self.token.encode()):
            return respond(403, "Forbidden", b"wrong token; open the exact URL tapml printed\n")
        rest = "/".join(parts[2:])
        if not rest and not path.endswith("/"):  # the page loads runtime.js and ws relative to its own URL
            location = f"/t/{self.token}/"
            return Response(301, "Moved Permanently", Headers([("Location", location), ("Content-Length", "0"),
                                                               ("Connection", "close")]), b"")
        if rest == "ws":
            if not self.origin_allowed(request.headers.get("Origin"), request.headers.get("Host")):
                return respond(403, "Forbidden", b"the WebSocket must come from the tapml page itself (wrong or "
                                                 b"missing Origin); open the exact URL tapml printed\n")
            if self._token_used:
                return respond(403, "Forbidden", b"this URL was already used by another page; each URL tapml "
                                                 b"prints attaches one page\n")
            self._token_used = True
            self._session = connection
            return None  # go on with the WebSocket handshake
        if rest in _STATIC:
            name, ctype = _STATIC[rest]
            return respond(200, "OK", (WEB_DIR / name).read_bytes(), ctype)
        return respond(404, "Not Found", b"no such file\n")

    @property
    def origin(self) -> str:
        """The page's http origin (scheme, host, port of :attr:`url`)."""
        return self.url.split("/t/", 1)[0]

    def origin_allowed(self, origin: str | None, host: str | None = None) -> bool:
        """Whether a WebSocket upgrade with this ``Origin`` (and ``Host``) header comes from the page.

        Allowed: the origin of :attr:`url`, and a loopback origin (127.0.0.1, localhost, [::1], any
        port) that names the very ``Host`` the request was sent to: the page opened through a
        loopback forward such as ``ssh -L`` or ``adb reverse``. A page of another site cannot send
        that pair (its Origin and Host name its own domain, even after DNS rebinding), and a
        client without an Origin is no browser page at all."""
        key = _origin_key(origin) if origin else None
        if key is None:
            return False
        if key == _origin_key(self.origin):
            return True
        return key[1] in LOOPBACK_NAMES and host is not None and key == _origin_key(f"http://{host}")

    async def _handler(self, ws):
        if ws is not self._session:  # only the connection that spent this token is the page
            await ws.close(1008, "not the page session")
            return
        self._ws = ws
        reason = "the page closed its connection"
        try:
            async for message in ws:
                if isinstance(message, str):
                    refused = self._on_text(json.loads(message))
                    if refused:
                        reason = refused
                        break
                else:
                    self._on_frame(message)
        except Exception as e:  # noqa: BLE001 - any transport failure means the page is gone
            reason = f"connection to the page failed: {type(e).__name__}: {e}"
        finally:
            self._ws = None
            self._session = None
            self.mark_lost(reason)
            if self.rejoin and not self._closing:
                self._new_token()
                if not self.lost.endswith(REJOIN_HINT):
                    self.lost += REJOIN_HINT
                if self.on_url is not None:
                    self.on_url(self.url)

    def _on_text(self, msg: dict) -> str | None:
        """Handle a text message; returns a reason when the page must be dropped."""
        kind = msg.get("type")
        if kind == "hello":
            if msg.get("error") and self.pages:
                # a page rejoining without WebGPU: free its URL for another (the first page's
                # error is reported to whoever waits for the device instead)
                return f"the page that attached has no WebGPU adapter: {msg['error']}"
            if not msg.get("error"):
                self.pages += 1
                self.lost = None
            if not self.hello.done():
                self.hello.set_result(msg)
        elif kind == "lost":
            self.mark_lost(f"the browser lost its GPU device: {msg.get('message', '')}")
        elif kind in ("done", "error"):
            run = self._run  # the calling thread clears it when it stops waiting
            if run and run[0] == msg.get("id") and not run[1].done():
                run[1].set_result((msg, run[2]))
        return None

    def _on_frame(self, data: bytes) -> None:
        run_id, slot, kind, payload = decode_frame(data)
        run = self._run
        if kind == KIND_OUTPUT and run and run[0] == run_id:
            run[2][slot] = payload

    def mark_lost(self, reason: str) -> None:
        """The page is gone: every waiting and later call raises DeviceLost(reason). With
        ``rejoin`` a page that is still connected (hung, or its GPU device lost) is dropped,
        so that its URL is replaced by a fresh one."""
        if self.lost is None:
            self.lost = reason
        if not self.hello.done():
            self.hello.set_exception(DeviceLost(reason))
        if self._run and not self._run[1].done():
            self._run[1].set_exception(DeviceLost(reason))
        ws = self._ws
        if self.rejoin and ws is not None and not self._closing and not self._loop.is_closed():
            self.call_soon(ws.close())

    def wait(self, fut: concurrent.futures.Future, timeout: float, what: str, alive=None):
        """Wait for ``fut`` in short slices (so Ctrl-C and a dead browser are noticed at once)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return fut.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                pass
            if alive is not None:
                dead = alive()
                if dead:
                    self.mark_lost(dead)
            if time.monotonic() > deadline:
                self.mark_lost(f"no answer from the browser within {timeout:g}s while {what}")

    async def _send(self, messages: list) -> None:
        ws = self._ws
        if ws is None:
            raise DeviceLost(self.lost or "the page is not connected")
        for m in messages:
            await ws.send(m)

    def request(self, msg: dict, frames: list[bytes], timeout: float, alive=None) -> tuple[dict, dict[int, bytes]]:
        """Send a run message and its binary frames; return the page's reply and output frames by slot."""
        with self._lock:
            dead = alive() if alive is not None else None
            if dead:
                self.mark_lost(dead)
            if self.lost:
                raise DeviceLost(self.lost)
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._run = (msg["id"], fut, {})
            sent = self.call_soon(self._send([json.dumps(msg, separators=(",", ":"))] + frames))
            sent.add_done_callback(lambda f: not f.cancelled() and f.exception() and self.mark_lost(
                f"sending to the page failed: {f.exception()}"))
            try:
                return self.wait(fut, timeout, f"running {msg.get('key')}", alive)
            finally:
                self._run = None

    def close(self) -> None:
        """Stop serving and drop the page; waiting and later calls raise DeviceLost. Safe to call twice."""
        self._closing = True
        if not self._loop.is_closed() and self._thread.is_alive():
            async def shutdown():
                server = getattr(self, "_server", None)
                if server is not None:
                    server.close()
                    try:
                        await asyncio.wait_for(server.wait_closed(), 3)
                    except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - best effort on shutdown
                        pass
                # Connection handlers still pending would otherwise die later, outside a running loop.
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            try:
                self.call_soon(shutdown()).result(timeout=5)
            except Exception:  # noqa: BLE001
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._loop.close()
        self.mark_lost("the browser platform was closed")


PROFILE_PREFIX = "tapml-chromium-"


def _remove_stale_profiles() -> None:
    """Remove profiles left by tapml processes that were killed (SIGKILL skips cleanup)."""
    for profile in Path(tempfile.gettempdir()).glob(PROFILE_PREFIX + "*"):
        try:
            owner = int((profile / "tapml.pid").read_text())
            os.kill(owner, 0)
        except ProcessLookupError:
            shutil.rmtree(profile, ignore_errors=True)
        except (OSError, ValueError):
            pass  # not ours to judge (no pid file yet, or another user's)


def _write_start_file(profile: str, url: str) -> str:
    """A page in ``profile`` that forwards to ``url``; returns its file:// URL. The file is 0600 in
    the 0700 profile directory, so only this user (and the Chromium it starts) can read the URL."""
    path = os.path.join(profile, "start.html")
    target = escape(url, quote=True)
    page = (f'<!doctype html><meta charset="utf-8"><meta name="referrer" content="no-referrer">'
            f'<meta http-equiv="refresh" content="0; url={target}"><title>tapml</title>')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(page)
    return Path(path).as_uri()


class ChromiumProcess:
    """A headless Chromium on a fresh profile, in its own process group; :meth:`close` kills the
    group and removes the profile. It also dies with tapml (``atexit`` and a parent-death signal).

    ``url`` (which holds the page's one-time token) is never put on Chromium's command line, which
    every local user can read in ``/proc/PID/cmdline``: Chromium opens a start file in its private
    profile directory instead, and that file forwards it to ``url``."""

    def __init__(self, url: str, executable: str | None = None, extra_flags: tuple[str, ...] = ()):
        self.executable = executable or find_chromium()
        _remove_stale_profiles()
        self.profile = tempfile.mkdtemp(prefix=PROFILE_PREFIX)  # mode 0700: other users cannot look inside
        Path(self.profile, "tapml.pid").write_text(str(os.getpid()))
        self.log_path = os.path.join(self.profile, "chromium.log")
        start = _write_start_file(self.profile, url)
        cmd = [self.executable, *CHROMIUM_FLAGS, *extra_flags, f"--user-data-dir={self.profile}", start]
        setpriv = shutil.which("setpriv")
        if setpriv:  # SIGKILL chromium when the thread that started it (the bridge thread) dies
            cmd = [setpriv, "--pdeathsig", "KILL", "--", *cmd]
        env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR") or self.profile}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)
        self.pid = self.proc.pid
        atexit.register(self.close)

    def exited(self) -> str | None:
        """None while Chromium runs, else a sentence saying how it ended."""
        code = self.proc.poll()
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"the browser process {how}"

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def session_pids(self) -> list[int]:
        """Pids of every process still in Chromium's session (its helpers included)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if len(fields) > 3 and int(fields[3]) == self.pid and fields[0] != "Z":
                pids.append(int(entry))
        return pids

    def _gone_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for Chromium and every helper to exit; True when they did."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not self.session_pids():
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        """Terminate Chromium and its helpers, wait for them, remove the profile. Safe to call twice."""
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            for pid in self.session_pids():  # helpers that left the process group but not the session
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            if self._gone_within(grace):
                break
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.profile, ignore_errors=True)
        atexit.unregister(self.close)


class BrowserPlatform(Platform):
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
        self._on_page: set[str] = set()  # program keys the page of self._page has prepared
        self._page: concurrent.futures.Future | None = None
        self._hello: dict | None = None  # the last page's hello (its caps stay valid while a new page is awaited)
        self._plans: dict[str, tuple[dict, list[bytes]]] = {}
        executable = find_chromium() if launch and not chromium else chromium
        self._executable = executable
        self.relaunches = 0
        self.bridge = PageBridge(host, port, rejoin=not launch, on_url=on_url or _print_new_url)
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
        self.bridge = PageBridge(self.bridge.host, 0)
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
        dtypes = ["float32", "int32", "int64", "int16", "int8", "uint8", "bool"]
        if "shader-f16" in features:
            dtypes.insert(1, "float16")
        return {"adapter": adapter, "backend": "browser-webgpu", "browser": hello.get("userAgent", ""),
                "adapter_info": info, "features": features, "limits": dict(hello.get("limits") or {}),
                "dtypes": dtypes, "url": self.url}

    def _supports(self, node: Node) -> str | None:
        from tapml.platforms.wgsl import supports
        return supports(node, self.caps())

    def _compile(self, graph: Graph) -> KernelProgram:
        from tapml.platforms.wgsl import compile_graph
        return compile_graph(graph, self.caps())

    def _plan(self, program: KernelProgram) -> tuple[dict, list[bytes]]:
        """The page's view of a program (buffer sizes, const names, kernels) and the const bytes."""
        plan = self._plans.get(program.key)
        if plan is None:
            consts = [b for b in program.buffers if b.role == "const"]
            plan = ({"buffers": [{"name": b.name, "size": b.size} for b in program.buffers],
                     "consts": [b.name for b in consts],
                     "poison": [b.name for b in program.buffers if b.role == "output" and b.size],
                     "kernels": [k.to_json() for k in program.kernels]},
                    [b.data or b"" for b in consts])
            self._plans[program.key] = plan
            if len(self._plans) > 256:  # dicts keep insertion order: drop the oldest plan
                self._plans.pop(next(iter(self._plans)))
        return plan

    def _run(self, program: KernelProgram, inputs: list) -> list:
        from tapml.platforms.wgsl.codegen import ITEMSIZE
        from tapml.platforms.wgsl.tensors import read_output, to_device
        if program.kind != "wgsl":
            raise PlatformError(f"the browser runs wgsl KernelPrograms, not {program.kind!r} ones")
        if self._closed:
            raise DeviceLost("the browser platform was closed")
        check_workgroups(program, self.caps())
        if self.bridge.hello is not self._page:  # one hello future per page: a new page has no programs yet
            self._page = self.bridge.hello
            self._on_page.clear()
        specs = {b.name: b for b in program.buffers}
        payloads = [to_device(t, specs[name].dtype, f"input {name}") for name, t in zip(program.inputs, inputs)]
        metas = program.output_meta or [specs[n].meta for n in program.outputs]
        outputs = [[name, meta.numel * ITEMSIZE[specs[name].dtype]] for name, meta in zip(program.outputs, metas)]
        plan, consts = self._plan(program)
        for attempt in range(2):
            self._run_id += 1
            send_program = program.key not in self._on_page
            msg = {"type": "run", "id": self._run_id, "key": program.key, "program": plan if send_program else None,
                   "inputs": list(program.inputs), "outputs": outputs}
            frames = ([encode_frame(self._run_id, i, KIND_CONST, c) for i, c in enumerate(consts)] if send_program
                      else [])
            frames += [encode_frame(self._run_id, i, KIND_INPUT, p) for i, p in enumerate(payloads)]
            try:
                reply, got = self.bridge.request(msg, frames, self.run_timeout, self._alive)
            except DeviceLost as e:
                raise DeviceLost(self._crash_reason() or str(e)) from None
            if reply["type"] == "done":
                self._on_page.add(program.key)
                break
            if reply.get("code") == "no-program" and attempt == 0:
                self._on_page.discard(program.key)
                continue
            raise PlatformError(f"browser: {reply.get('message', 'run failed')}")
        if len(got) != len(outputs):
            raise PlatformError(f"the browser returned {len(got)} of {len(outputs)} outputs")
        return [read_output(got[i], specs[name].dtype, meta, name)
                for i, (name, meta) in enumerate(zip(program.outputs, metas))]

    def close(self) -> None:
        """Close the browser (if tapml launched it) and the server. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.browser is not None:
            self.browser.close()
        self.bridge.close()


def _print_new_url(url: str) -> None:
    print(f"the browser page is gone; open {url} in a browser with WebGPU to attach another", flush=True)


__all__ = ["BrowserPlatform", "ChromiumProcess", "PageBridge", "find_chromium", "encode_frame", "decode_frame"]
