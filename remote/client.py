"""``remote://HOST:PORT`` targets: a :class:`Platform` that runs on a ``tapml serve`` device server.

Structure travels as JSON over an authenticated rpyc connection; tensors travel over a second
authenticated socket as raw bytes with a small header (see :mod:`tapml.remote.protocol`).
The server compiles (for its own device, with its own cache of programs by graph hash, shared by
every client) and caches programs by content hash; this client is a
:class:`~tapml.platforms.base.RuntimePlatform` whose prepared programs are the ones the server
holds (``_prepare`` loads a program compiled elsewhere), so a repeated case sends only its tensors.

When the server goes away, calls raise :class:`~tapml.errors.DeviceLost` (an ``error: device
lost`` verdict, never a hang: every call has a timeout) and the next call reconnects.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import socket
import threading

from tapml.errors import DeviceLost, PlatformError, TapmlError, Unsupported
from tapml.platforms.base import KernelProgram, ResidentTensor, RuntimePlatform
from tapml.platforms.program_cache import ProgramCache
from tapml.remote import protocol as P

CLIENT_MAX_MESSAGE = 4 << 30
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "TAPML_REMOTE_TIMEOUT"


def call_timeout(timeout: float | None = None) -> float:
    """Seconds a remote call may take: ``timeout`` when given, else ``$TAPML_REMOTE_TIMEOUT``,
    else 300.

    Raises :class:`~tapml.errors.TapmlError` saying what to set when the value is not a
    positive number of seconds. Example: ``call_timeout()`` is ``600.0`` with
    ``TAPML_REMOTE_TIMEOUT=600`` in the environment.
    """
    if timeout is not None:
        return _seconds(timeout, f"timeout={timeout!r}", "pass a positive number of seconds")
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    return _seconds(text, f"{TIMEOUT_ENV}={text!r}",
                    f"set {TIMEOUT_ENV} to the seconds a remote call may take (a positive number such as "
                    f"600), or unset it for {DEFAULT_TIMEOUT_S:g}")


def _seconds(value, what: str, fix: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise TapmlError(f"{what} is not a positive number of seconds; {fix}")
    return seconds


class _UnknownProgram(Exception):
    pass


class _UnknownInput(Exception):
    pass


SERVER_STATE_LOST = ("the device server no longer holds that resident tensor (the connection to it was lost or "
                     "re-opened, or a failed run dropped it); run the generation again from its first step")


class RemotePlatform(RuntimePlatform):
    """A platform served by ``tapml serve`` at ``host:port``.

    ``token`` is the shared secret (None for a server started without one); ``timeout`` bounds
    every call in seconds (compiling and running a large region on a slow device can take a
    while; default ``$TAPML_REMOTE_TIMEOUT``, else 300), ``connect_timeout`` the connection
    and handshake.

    Example::

        with RemotePlatform("127.0.0.1", 18861, token=read_token()) as p:
            outputs = p.run(p.compile(graph), inputs)

    Raises :class:`~tapml.errors.TapmlError` when a timeout is not a positive number of
    seconds, or when the server cannot be reached or refuses the token at construction time.
    """

    program_kinds = ("wgsl", "graph")  # a reference server runs graphs

    def __init__(self, host: str, port: int, token: str | None = None, *, timeout: float | None = None,
                 connect_timeout: float = 10.0):
        self.host, self.port, self.token = host, int(port), token
        self.name = f"remote://{host}:{port}"
        self.timeout = call_timeout(timeout)
        self.connect_timeout = _seconds(connect_timeout, f"connect_timeout={connect_timeout!r}",
                                        "pass a positive number of seconds")
        super().__init__()  # self.programs: keys of the programs the server holds for us
        self.info: dict = {}
        self._conn = None
        self._bulk: P.Link | None = None
        self._calls: dict = {}
        self._compiled = ProgramCache()  # graph JSON hash -> the program the server compiled from it
        self._support_cache = ProgramCache()  # node JSON -> the server's reason ('' when supported)
        self._slots = itertools.count(1)
        self._lock = threading.RLock()
        #: what this client sent: control calls by name, tensor bytes each way
        self.stats: dict = {"calls": {}, "bytes_up": 0, "bytes_down": 0}
        # what this connection's server session holds: per program, the inputs it was sent last
        # (position -> (tensor, _version); an unmodified one is named, not sent again) and the ids
        # of the outputs it kept on the device ((program key, output) -> id)
        self._sent: dict[str, dict[int, tuple]] = {}
        self._resident_ids: dict[tuple[str, int], int] = {}
        try:
            self._connect()
        except (P.AuthError, OSError, EOFError, TimeoutError) as e:
            raise TapmlError(self._connect_failure(e)) from None

    # --- connection -----------------------------------------------------------------------
    def _connect_failure(self, e: BaseException) -> str:
        if isinstance(e, P.AuthError):
            return f"{self.name}: {e}"
        if isinstance(e, ConnectionRefusedError):
            return (f"nothing listens at {self.host}:{self.port}; start a device server there with "
                    f"`tapml serve --port {self.port}` or fix the address")
        return f"cannot reach the device server at {self.host}:{self.port}: {e}"

    def _socket(self, role: str) -> tuple[socket.socket, P.Handshake]:
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        try:
            P.tune(sock)
            auth = P.client_handshake(sock, self.token, role, timeout=self.connect_timeout)
            sock.settimeout(self.timeout)
        except BaseException:
            sock.close()
            raise
        return sock, auth

    def _connect(self) -> None:
        import rpyc
        from rpyc.core.stream import SocketStream
        sock, auth = self._socket("control")
        config = {"allow_pickle": False, "allow_public_attrs": False, "allow_all_attrs": False,
                  "include_local_traceback": False, "include_local_version": False,
                  "sync_request_timeout": self.timeout}
        conn = rpyc.connect_channel(P.limited_channel(SocketStream(sock), CLIENT_MAX_MESSAGE, auth),
                                    service=rpyc.VoidService, config=config)
        try:
            root = conn.root
            calls = {name: getattr(root, name) for name in
                     ("hello", "ping", "supports", "compile", "load", "run", "read", "free", "bench_tensor", "stats")}
            info = json.loads(calls["hello"]())
            if "error" in info:
                raise P.AuthError(f"the device server cannot open its device: {info['error']['message']}")
            if info.get("protocol") != P.PROTOCOL_VERSION:
                raise P.AuthError(f"the server speaks protocol {info.get('protocol')}, this tapml speaks {P.PROTOCOL_VERSION}; "
                                  "use the same tapml version on both sides")
            if info.get("server_id") != auth.server_id.hex():
                raise P.AuthError("the server's hello names another server than its handshake did")
            sock_b, auth_b = self._socket("bulk")
            bulk = P.Link(sock_b, auth_b)
            try:
                if auth_b.server_id != auth.server_id:  # both connections must reach the same server
                    raise P.AuthError("the bulk connection reached another server than the control connection "
                                      "(something between this client and the server relays connections)")
                bulk.send(P.SESS, 0, bytes.fromhex(info["session"]))
                kind, _, _, _, payload = bulk.recv(4096)
                if kind != P.ACK:
                    raise P.AuthError(payload.decode(errors="replace"))
            except BaseException:
                bulk.close()
                raise
        except BaseException:
            conn.close()
            raise
        if info["server_id"] != self.info.get("server_id"):
            self.programs.clear()  # a new server process has an empty program cache
        self._conn, self._bulk, self._calls, self.info = conn, bulk, calls, info

    def _drop(self) -> None:
        conn, bulk = self._conn, self._bulk
        self._conn = self._bulk = None
        self._calls = {}
        self._sent.clear()  # the server's session, and all it held, ends with the connection
        self._resident_ids.clear()
        for closer in (getattr(conn, "close", None), getattr(bulk, "close", None)):
            try:
                if closer:
                    closer()
            except Exception:  # noqa: BLE001 - already broken
                pass

    def reconnect(self) -> None:
        """Drop the connection and open a new one; DeviceLost when the server is still away."""
        with self._lock:
            self._drop()
            self._ensure()

    def _ensure(self) -> None:
        if self._conn is None:
            try:
                self._connect()
            except (P.AuthError, OSError, EOFError, TimeoutError) as e:
                self._drop()
                raise DeviceLost(f"{self.name}: reconnect failed: {self._connect_failure(e)}") from None

    def _lost(self, e: BaseException) -> DeviceLost:
        self._drop()
        what = "no reply within the timeout" if isinstance(e, TimeoutError) else (str(e) or type(e).__name__)
        return DeviceLost(f"{self.name}: {what}")

    def _call(self, name: str, *args):
        """One control call (under the lock: the connection may be replaced by a reconnect);
        transport failures become DeviceLost."""
        with self._lock:
            self._ensure()
            self.stats["calls"][name] = self.stats["calls"].get(name, 0) + 1
            try:
                return self._calls[name](*args)
            except (EOFError, OSError, TimeoutError, P.ProtocolError) as e:
                raise self._lost(e) from None

    @staticmethod
    def _raise(error: dict):
        kind, message = error.get("kind"), error.get("message", "")
        if kind == "unsupported":
            raise Unsupported(message)
        if kind in ("device-lost", "device-busy"):  # not a verdict about the program: retry later
            raise DeviceLost(message)
        if kind == "unknown-program":
            raise _UnknownProgram(message)
        if kind == "unknown-input":
            raise _UnknownInput(message)
        if kind == "unknown-resident":
            raise PlatformError(f"{SERVER_STATE_LOST}: {message}")
        raise PlatformError(message)

    # --- Platform hooks ---------------------------------------------------------------------
    def _caps(self) -> dict:
        with self._lock:
            if not self.info:
                self._ensure()
            return dict(self.info["caps"])

    def _supports(self, node) -> str | None:
        key = json.dumps(node.to_json(), sort_keys=True)
        reason = self._support_cache.get(key)
        if reason is None:
            reply = json.loads(self._call("supports", key))
            if "error" in reply:  # the device failed to answer: a fault, not a property of the op
                self._raise(reply["error"])
            reason = reply.get("reason") or ""
            self._support_cache.put(key, reason)
        return reason or None

    def _compile(self, graph) -> KernelProgram:
        """The server compiles for its own device (and keeps the program): one compiler and one
        cache per device, shared by its clients; the graph crosses once."""
        caps = self.caps()
        if caps.get("forced_limits") and not str(caps.get("backend")).startswith("torch-"):  # not a reference server
            # tighter limits than the device's own (force_limits): compiled here for them, then
            # loaded like any program compiled elsewhere (the server checks it all the same)
            from tapml.platforms.wgsl import compile_graph
            return compile_graph(graph, caps)
        text = json.dumps(graph.to_json(), sort_keys=True, separators=(",", ":"))
        ghash = hashlib.sha256(text.encode()).hexdigest()
        with self._lock:
            program = self._compiled.get(ghash)
            if program is not None and program.key in self.programs:
                return program
            if len(text) > self.info.get("max_request", CLIENT_MAX_MESSAGE):
                raise Unsupported(f"graph JSON of {len(text)} bytes exceeds the server's request limit of "
                                  f"{self.info.get('max_request')}; start it with a larger --max-request-mib")
            reply = json.loads(self._call("compile", text))
            if "error" in reply:
                self._raise(reply["error"])
            program = KernelProgram.from_json(reply["program"])
            self._compiled.put(ghash, program)
            self.programs.put(program.key, True)
            return program

    def _run(self, program: KernelProgram, inputs: list) -> list:
        self._check_sizes(inputs)
        with self._lock:
            self._ensure()
            return super()._run(program, inputs)

    def _run_resident(self, program: KernelProgram, inputs: list, keep: list[int]) -> list:
        """Resident inputs are named to the server, which passes them to its device; kept
        outputs stay there (the server answers with their ids)."""
        self._check_sizes(inputs)
        with self._lock:
            self._ensure()
            return self._run_remote(program, self.prepared(program), inputs, keep)

    def _read_resident(self, handle):
        with self._lock:
            rid = self._resident_ids.get((handle.program, handle.output))
            if rid is None or self._conn is None:
                raise PlatformError(SERVER_STATE_LOST)
            reply = json.loads(self._call("read", rid))
            if "error" in reply:
                self._raise(reply["error"])
            return self._fetch(reply["outputs"])[0]

    def _check_sizes(self, inputs: list) -> None:
        limit = self.info.get("max_message", CLIENT_MAX_MESSAGE)
        for i, t in enumerate(inputs):
            if isinstance(t, ResidentTensor):
                continue
            if t.numel() * t.element_size() > limit:
                raise PlatformError(f"input {i} is {t.numel() * t.element_size()} bytes, over the device "
                                    f"server's message limit of {limit}; restart it with a larger "
                                    "--max-message-mib")

    def _prepare(self, program: KernelProgram) -> tuple[bool, int]:
        """Load a program compiled elsewhere into the server's cache."""
        reply = json.loads(self._call("load", program.dumps()))
        if "error" in reply:
            self._raise(reply["error"])
        return True, 0

    def _execute(self, program: KernelProgram, prepared, inputs: list) -> list:
        return self._run_remote(program, prepared, inputs, [])

    def _run_remote(self, program: KernelProgram, prepared, inputs: list, keep: list[int]) -> list:
        for attempt in range(3):
            try:
                return self._run_once(program, inputs, keep)
            except _UnknownProgram:  # the server restarted or evicted it
                self.forget(program.key)
                self.prepared(program)
            except _UnknownInput:  # the server dropped what it held for it: send every input
                self._sent.pop(program.key, None)
        raise PlatformError(f"the device server kept dropping program {program.key[:12]}; raise its "
                            "TAPML_PROGRAM_CACHE / --max-buffer-mib")

    def _run_once(self, program: KernelProgram, inputs: list, keep: list[int]) -> list:
        held = self._sent.get(program.key, {})
        items, send = [], []
        for pos, t in enumerate(inputs):
            if isinstance(t, ResidentTensor):
                rid = self._resident_ids.get((t.program, t.output))
                if rid is None:
                    raise PlatformError(f"input {pos}: {SERVER_STATE_LOST}")
                items.append({"resident": rid})
            elif (last := held.get(pos)) is not None and last[0] is t and last[1] == t._version:
                items.append("held")  # the server holds this very tensor from the last run
            else:
                items.append(next(self._slots))
                send.append((pos, items[-1], t))
        slots = [slot for _, slot, _ in send]
        try:
            for _, slot, t in send:
                self._bulk.send_tensor(P.PUT, slot, t)
                self.stats["bytes_up"] += t.numel() * t.element_size()
                self.upload_bytes += t.numel() * t.element_size()
        except (OSError, EOFError) as e:
            raise self._lost(e) from None
        except ValueError as e:
            self._call("free", json.dumps(slots))
            raise Unsupported(str(e)) from None
        request = {"inputs": items, "keep": list(keep)} if keep or len(slots) != len(items) else slots
        reply = json.loads(self._call("run", program.key, json.dumps(request)))
        if "error" in reply:
            # after a failed run the server holds nothing of this program
            self._sent.pop(program.key, None)
            self._forget_kept(program.key, len(program.outputs))
            self._raise(reply["error"])
        held = self._sent.setdefault(program.key, held)
        for pos, t in enumerate(inputs):
            if isinstance(t, ResidentTensor):
                held.pop(pos, None)
        held.update({pos: (t, t._version) for pos, _, t in send})
        self._forget_kept(program.key, len(program.outputs))
        for pos, rid in reply.get("resident", []):
            if type(pos) is not int or type(rid) is not int or pos not in keep:
                raise self._lost(P.ProtocolError(f"the server kept output {pos!r} as {rid!r}; asked for {keep}"))
            self._resident_ids[(program.key, pos)] = rid
        self.last_wide = P.two_word_refs(reply.get("int64_two_words"))
        outputs = reply["outputs"]
        if len(outputs) != len(program.outputs) or any((slot is None) != (i in keep) for i, (slot, _) in enumerate(outputs)):
            raise self._lost(P.ProtocolError("the server's outputs do not match the program's"))
        fetched = iter(self._fetch([o for o in outputs if o[0] is not None]))
        return [None if slot is None else next(fetched) for slot, _ in outputs]

    def _forget_kept(self, key: str, count: int) -> None:
        for i in range(count):
            self._resident_ids.pop((key, i), None)

    def _fetch(self, outputs: list) -> list:
        """Download the tensors of output slots ``[[slot, meta], ...]`` (freeing them there)."""
        try:
            for slot, _ in outputs:
                self._bulk.send(P.GET, slot)
            results, errors = [], []
            for slot, meta in outputs:
                kind, got, dtype, shape, nbytes = self._bulk.recv_header(CLIENT_MAX_MESSAGE)
                payload = self._bulk.recv_payload(nbytes)
                if kind == P.ERR:
                    errors.append(payload.decode(errors="replace"))
                    continue
                if kind != P.TENSOR or got != slot:
                    raise P.ProtocolError(f"expected tensor of slot {slot}, got {kind!r} for slot {got}")
                t = P.tensor_from(dtype, shape, payload)
                self.stats["bytes_down"] += nbytes
                if list(t.shape) != meta["shape"]:
                    raise P.ProtocolError(f"output slot {slot} has shape {list(t.shape)}, announced {meta['shape']}")
                results.append(t)
        except (OSError, EOFError, P.ProtocolError) as e:
            raise self._lost(e) from None
        if errors:
            raise PlatformError(f"device server: {errors[0]}")
        return results

    # --- transport primitives (benchmarks) ------------------------------------------------------
    def ping(self) -> None:
        """One empty control call (a round trip)."""
        self._call("ping")

    def upload(self, tensor) -> int:
        """Put ``tensor`` in a server slot and wait for the server to hold it; returns the slot."""
        with self._lock:
            self._ensure()
            slot = next(self._slots)
            try:
                self._bulk.send_tensor(P.PUTA, slot, tensor)
                kind, _, _, _, payload = self._bulk.recv(1 << 20)
            except (OSError, EOFError, P.ProtocolError) as e:
                raise self._lost(e) from None
            if kind != P.ACK:
                raise PlatformError(f"device server: {payload.decode(errors='replace')}")
            return slot

    def download(self, slot: int, keep: bool = False):
        """Fetch the tensor in ``slot`` (freeing it unless ``keep``)."""
        with self._lock:
            self._ensure()
            try:
                self._bulk.send(P.GETK if keep else P.GET, slot)
                kind, _, dtype, shape, payload = self._bulk.recv(CLIENT_MAX_MESSAGE)
            except (OSError, EOFError, P.ProtocolError) as e:
                raise self._lost(e) from None
            if kind != P.TENSOR:
                raise PlatformError(f"device server: {payload.decode(errors='replace')}")
            return P.tensor_from(dtype, shape, payload)

    def server_stats(self) -> dict:
        """The server's counters: ``compiled`` (programs it compiled), ``cached`` (programs in its
        cache), ``runs``, ``sessions``, ``worker_restarts`` (device workers replaced after a timeout or crash)."""
        return json.loads(self._call("stats"))

    def free(self, slots: list[int]) -> None:
        """Drop server-side tensors (from :meth:`upload` or :meth:`bench_tensor`) that will not be downloaded."""
        self._call("free", json.dumps(list(slots)))

    def bench_tensor(self, nbytes: int) -> int:
        """A float32 tensor of ``nbytes`` made on the server; returns its slot."""
        try:
            return self._call("bench_tensor", int(nbytes))
        except DeviceLost:
            raise
        except Exception as e:  # noqa: BLE001 - the server's refusal (rpyc re-raises it here)
            raise PlatformError(f"device server: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def raw_socket(self) -> P.Link:
        """An authenticated connection to the server's baseline endpoint (SINK/SOURCE/PING,
        framed and tagged as bulk messages)."""
        try:
            return P.Link(*self._socket("raw"))
        except (P.AuthError, OSError, EOFError) as e:
            raise DeviceLost(f"{self.name}: {e}") from None

    def close(self) -> None:
        """Close the connection (the server keeps its programs for the next client)."""
        with self._lock:
            self._drop()
