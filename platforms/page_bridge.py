"""The page bridge of the ``browser`` target: the runtime page, its WebSocket, and the frame codec.

:class:`PageBridge` serves a page (``platforms/web/index.html`` + ``runtime.js`` by default) and one WebSocket
connection to the page from a background thread running its own asyncio loop. Tensors travel
as binary frames with a 16-byte header (``TPT1``, run id, slot, kind) holding device bytes,
never as JSON arrays (:func:`encode_frame`, :func:`decode_frame`). Once the page has reported
its adapter (``hello``), the bridge answers ``welcome`` with the page's program-cache limits,
so the page keeps as many prepared programs as the host's ProgramCache (``TAPML_PROGRAM_CACHE``,
``TAPML_PROGRAM_CACHE_MIB``).

The WebSocket upgrade needs the URL's one-time token, an ``Origin`` that is the bridge's own
http origin, and a token that no page has used yet: one token, one connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import secrets
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from tapml.errors import DeviceLost, TapmlError

WEB_DIR = Path(__file__).with_name("web")
FRAME = struct.Struct("<IIII")  # magic, run id, slot, kind
FRAME_MAGIC = 0x31545054  # b"TPT1" as little-endian u32
KIND_INPUT, KIND_CONST, KIND_OUTPUT = 0, 1, 2
HTML, JS, WASM = "text/html; charset=utf-8", "text/javascript; charset=utf-8", "application/wasm"
#: The files of the ``browser`` target's page: URL path under the token -> (file, content type).
KERNEL_PAGE = {"": (WEB_DIR / "index.html", HTML), "index.html": (WEB_DIR / "index.html", HTML),
               "runtime.js": (WEB_DIR / "runtime.js", JS), "frames.js": (WEB_DIR / "frames.js", JS)}


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

    ``program_cache`` (``{"max_programs", "max_bytes"}``, default: the ProgramCache limits of
    the environment) is sent to each page in ``welcome``, before it is told to run anything.
    ``files`` is what the bridge serves under the token (URL path -> (file, content type)): the
    ``browser`` target's kernel page by default; nothing else is ever read from the disk.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, rejoin: bool = False,
                 on_url: Callable[[str], None] | None = None, program_cache: dict | None = None,
                 files: dict[str, tuple[Path, str]] | None = None):
        from tapml.platforms.program_cache import default_limits
        self.host = host
        self.files = dict(files if files is not None else KERNEL_PAGE)
        entries, nbytes = default_limits()
        #: sent to each page in ``welcome``: how many prepared programs (and bytes of their buffers) it keeps
        self.program_cache = program_cache or {"max_programs": entries, "max_bytes": nbytes}
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
        if rest in self.files:
            file, ctype = self.files[rest]
            return respond(200, "OK", Path(file).read_bytes(), ctype)
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
                    msg = json.loads(message)
                    if msg.get("type") == "hello" and not msg.get("error"):
                        # before the hello is handed on: the page has its limits before its first run
                        await ws.send(json.dumps({"type": "welcome", **self.program_cache}))
                    refused = self._on_text(msg)
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

    def post(self, msg: dict) -> None:
        """Send the page a text message that has no reply (best effort: a lost page drops it)."""
        if self._ws is not None and not self.lost:
            sent = self.call_soon(self._send([json.dumps(msg, separators=(",", ":"))]))
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # observed: a lost page is no news here

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


__all__ = ["KERNEL_PAGE", "PageBridge", "encode_frame", "decode_frame", "FRAME", "FRAME_MAGIC", "KIND_INPUT", "KIND_CONST",
           "KIND_OUTPUT", "MAX_FRAME"]
