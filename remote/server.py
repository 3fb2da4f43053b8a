"""The device server behind ``tapml serve``: one local platform, shared by authenticated clients.

Design: the server compiles. A client sends a graph as JSON (``compile``), the server compiles
it with its own platform for its own device's caps, caches the KernelProgram by content hash
(``KernelProgram.key``) and answers with the program. ``run`` then names the program by key
and its inputs by *slots* that the client filled over the bulk connection; outputs come back
the same way. So one compiler runs per device, the client needs nothing of the server's
platform, and a repeated case sends only its tensors.

Every connection proves the shared token first (:mod:`tapml.remote.protocol`); the rpyc
service exposes only ``exposed_*`` methods taking and returning str/bytes/int/None, with
pickle off and no classic mode. Device calls are serialized by one lock; transfers are not.

Nothing a client sends reaches the device unchecked: op names go through the closed vocabulary,
programs are validated and held to the server's :class:`~tapml.remote.limits.ServerLimits`
(invocations, buffer bytes), and the device itself runs in a worker process
(:mod:`tapml.remote.device_worker`) that is killed when a compile or run passes the wall-clock limit.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import signal
import socket
import threading
import time

from tapml.errors import DeviceLost, PlatformError, TapmlError, Unsupported
from tapml.remote import protocol as P
from tapml.remote.limits import (MAX_SLOTS, LimitExceeded, ServerLimits, check_graph, check_node, check_ops_json,
                                 check_program, parse_request)

PROTOCOL_VERSION = P.PROTOCOL_VERSION
DEFAULT_PORT = 18861
DEFAULT_MAX_MESSAGE = 1 << 30
SERVICE_NAME = "TAPML"
OUTPUT_SLOTS = 1 << 62  # server-assigned slot ids; clients use ids below this
MAX_RESIDENT = 4096  # outputs one connection may keep on the device at once
STOP_GRACE_S = 3.0  # after SIGTERM/SIGINT, the process exits this soon whatever is still running

log = logging.getLogger("tapml.serve")


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _error(kind: str, message: str) -> str:
    return json.dumps({"error": {"kind": kind, "message": message}})


def _error_of(e: BaseException) -> str:
    if isinstance(e, Unsupported):
        return _error("unsupported", str(e))
    if isinstance(e, DeviceBusy):
        return _error("device-busy", str(e))
    if isinstance(e, DeviceLost):
        return _error("device-lost", str(e))
    if isinstance(e, PlatformError):
        return _error("platform", str(e))
    return _error("platform", f"{type(e).__name__}: {e}")


class DeviceBusy(PlatformError):
    """Another client held the device for longer than a request may wait for it."""


class NotHeld(Exception):
    """A run names a tensor this connection does not hold; ``kind`` is ``unknown-input`` (the
    client sends it again) or ``unknown-resident`` (a kept output that is gone)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ConnectionState:
    """Server-side state of one client's control connection: tensors waiting in slots, its bulk
    sockets, the id that binds them, and what it keeps between runs: the last input tensors of
    each program it ran (an unmodified input is named, not sent again: weights cross once) and
    the outputs its runs kept on the device (resident tensors, by id). Both are bounded by
    ``max_bytes`` (the server's --max-buffer-mib) and freed with the connection."""

    def __init__(self, max_bytes: int = 4096 << 20):
        from tapml.platforms.program_cache import ProgramCache
        self.id = os.urandom(16)
        self.slots: dict[int, object] = {}
        self.max_bytes = max_bytes
        self.held = ProgramCache(max_bytes=max_bytes)  # program key -> its last inputs (None: resident)
        self.resident: dict[int, object] = {}  # id -> the platform's ResidentTensor
        self.resident_of: dict[tuple[str, int], int] = {}  # (program key, output) -> id
        self._resident_ids = itertools.count(1)
        self.cond = threading.Condition()
        self.error: str | None = None
        self.sockets: list[socket.socket] = []
        self._out = itertools.count(OUTPUT_SLOTS)
        self.closed = False
        self.slot_bytes = 0  # bytes of the tensors in slots, and of uploads admitted but still arriving

    def reserve(self, nbytes: int, what: str = "an upload") -> None:
        """Admit ``nbytes`` more into this connection's slots, before they are read or made;
        LimitExceeded past ``max_bytes`` or :data:`MAX_SLOTS` tensors."""
        with self.cond:
            if len(self.slots) >= MAX_SLOTS or self.slot_bytes + nbytes > self.max_bytes:
                raise LimitExceeded(f"{what} of {nbytes} bytes: this connection already holds {len(self.slots)} tensors "
                                    f"({self.slot_bytes} bytes) that were not run or downloaded; this server allows "
                                    f"{MAX_SLOTS} and {self.max_bytes} bytes per connection (tapml serve --max-buffer-mib)")
            self.slot_bytes += nbytes

    def release(self, nbytes: int) -> None:
        with self.cond:
            self.slot_bytes -= nbytes

    def pop(self, slot: int):
        """Remove and return the tensor of ``slot`` (None when empty); the caller holds ``cond``."""
        tensor = self.slots.pop(slot, None)
        if tensor is not None:
            self.slot_bytes -= tensor.numel() * tensor.element_size()
        return tensor

    def put(self, slot: int, tensor) -> None:
        """Fill ``slot`` with an upload whose bytes were :meth:`reserve`d."""
        with self.cond:
            self.pop(slot)
            self.slots[slot] = tensor
            self.cond.notify_all()

    def take(self, slots: list[int], timeout: float) -> list:
        """Remove and return the tensors of ``slots``, waiting for uploads still in flight."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(s in self.slots for s in slots):
                if self.error or self.closed:
                    raise PlatformError(f"input upload failed: {self.error or 'session closed'}")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [s for s in slots if s not in self.slots]
                    raise PlatformError(f"inputs {missing} did not arrive within {timeout:g}s")
                self.cond.wait(left)
            return [self.pop(s) for s in slots]

    def store(self, tensor, what: str = "an output", reserved: bool = False) -> int:
        """Put a tensor made on the server in a fresh slot; LimitExceeded when this connection
        holds too much already (:meth:`reserve`; ``reserved``: its bytes were reserved before it was made)."""
        if not reserved:
            self.reserve(tensor.numel() * tensor.element_size(), what)
        slot = next(self._out)
        with self.cond:
            self.slots[slot] = tensor
        return slot

    def fail(self, message: str) -> None:
        with self.cond:
            self.error = message
            self.cond.notify_all()

    def run_args(self, key: str, items: list, tensors: list, count: int) -> list:
        """A run's inputs: ``items`` (slot, ``"held"`` or ``{"resident": id}``) resolved to the
        tensors that arrived in the slots, the ones held from the last run, or resident tensors."""
        if len(items) != count:
            raise ValueError(f"program takes {count} inputs, the run names {len(items)}")
        held = self.held.get(key) or []
        sent = iter(tensors)
        args = []
        for pos, item in enumerate(items):
            if type(item) is int:
                args.append(next(sent))
            elif item == "held":
                if pos >= len(held) or held[pos] is None:
                    raise NotHeld("unknown-input", f"input {pos} of program {key[:12]} is not held for this "
                                                   "connection; send it")
                args.append(held[pos])
            else:
                handle = self.resident.get(item["resident"])
                if handle is None:
                    raise NotHeld("unknown-resident", f"resident tensor {item['resident']} is not held for this "
                                                      "connection (the run that kept it failed, or a later run of "
                                                      "its program replaced it); run the generation again from "
                                                      "its first step")
                args.append(handle)
        return args

    def check_keep(self, program, keep: list[int]) -> None:
        """LimitExceeded when keeping ``keep`` of ``program`` would hold more than ``max_bytes``
        or :data:`MAX_RESIDENT` outputs for this connection (its earlier ones are replaced)."""
        replaced = {self.resident_of.get((program.key, i)) for i in range(len(program.outputs))}
        others = [h for rid, h in self.resident.items() if rid not in replaced]
        nbytes = sum(h.nbytes for h in others) + sum(program.output_meta[i].nbytes for i in keep)
        if len(others) + len(keep) > MAX_RESIDENT or nbytes > self.max_bytes:
            raise LimitExceeded(f"keeping {len(others) + len(keep)} tensors ({nbytes} bytes) on the device for one "
                                f"connection; this server allows {MAX_RESIDENT} and {self.max_bytes} bytes "
                                "(tapml serve --max-buffer-mib)")

    def after_run(self, program, args: list, keep: list[int], outputs: list) -> list[list[int]]:
        """Record a run: its inputs are held, its kept outputs get ids (``[[position, id]]``);
        the earlier kept outputs of the program are stale now and dropped."""
        from tapml.platforms.base import ResidentTensor
        host = [None if isinstance(a, ResidentTensor) else a for a in args]
        self.held.put(program.key, host, sum(t.numel() * t.element_size() for t in host if t is not None))
        self.forget_kept(program.key, len(program.outputs))
        ids = []
        for i in keep:
            rid = next(self._resident_ids)
            self.resident[rid] = outputs[i]
            self.resident_of[(program.key, i)] = rid
            ids.append([i, rid])
        return ids

    def forget_kept(self, key: str, count: int) -> None:
        for i in range(count):
            rid = self.resident_of.pop((key, i), None)
            if rid is not None:
                self.resident.pop(rid, None)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.slots.clear()
            self.slot_bytes = 0
            self.cond.notify_all()
        self.held.clear()
        self.resident.clear()
        self.resident_of.clear()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Device:
    """The platform a server exposes, its limits, its program cache and the open connections.

    ``lock`` serializes device calls (:meth:`exclusive` waits for it at most
    ``limits.run_timeout`` seconds); the program cache (a
    :class:`~tapml.platforms.program_cache.ProgramCache`, ``TAPML_PROGRAM_CACHE`` /
    ``TAPML_PROGRAM_CACHE_MIB``) has its own lock, so that a cache hit never waits for a device
    call of another client.
    """

    def __init__(self, platform, spec: str, max_message: int = DEFAULT_MAX_MESSAGE, timeout: float = 300.0,
                 limits: ServerLimits | None = None):
        self.platform = platform
        self.spec = spec
        self.max_message = max_message
        self.timeout = timeout
        self.limits = limits or ServerLimits()
        from tapml.platforms.targets import backend_prefix
        # the reference and external backends run graphs (an external backend compiles them itself)
        self.program_kind = "graph" if spec.startswith("reference") or backend_prefix(spec) is not None else "wgsl"
        self.lock = threading.Lock()
        from tapml.platforms.program_cache import ProgramCache
        self.programs = ProgramCache(on_evict=self._forget_graphs)
        self.graph_keys: dict[str, str] = {}  # graph JSON hash -> key of the program compiled from it
        self.sessions: dict[bytes, ConnectionState] = {}
        self.server_id = os.urandom(P.SERVER_ID).hex()  # stated in every handshake
        self._caps: dict | None = None
        self.compiled = 0
        self.runs = 0

    @property
    def caps(self) -> dict:
        # Lazy: a browser served with --no-launch has no adapter until someone opens its page.
        if self._caps is None:
            with self.exclusive():
                if self._caps is None:
                    self._caps = self.platform.caps()
        return self._caps

    @contextlib.contextmanager
    def exclusive(self):
        """Hold the device for one call; DeviceBusy when another client holds it for longer than
        ``limits.run_timeout`` (the most one call may take), so a waiting client gets an answer."""
        if not self.lock.acquire(timeout=self.limits.run_timeout):
            raise DeviceBusy(f"device busy: other clients held it for {self.limits.run_timeout:g} s "
                             "(the server's --run-timeout); retry later")
        try:
            yield
        finally:
            self.lock.release()

    def info(self, session: ConnectionState) -> dict:
        return {"protocol": PROTOCOL_VERSION, "platform": self.spec, "caps": self.caps,
                "max_message": self.max_message, "max_request": self.limits.max_request_bytes,
                "session": session.id.hex(), "server_id": self.server_id,
                "limits": {"max_invocations": self.limits.max_invocations,
                           "max_buffer_bytes": self.limits.max_buffer_bytes, "run_timeout": self.limits.run_timeout,
                           "max_request_bytes": self.limits.max_request_bytes,
                           "max_request_elements": self.limits.max_request_elements}}

    def program(self, key: str | None = None, graph_hash: str | None = None):
        """The cached program of ``key`` (or of the graph whose JSON hashes to ``graph_hash``),
        marked as just used; None when it is not cached."""
        if key is None:
            key = self.graph_keys.get(graph_hash)
        return self.programs.get(key) if key is not None else None

    def remember(self, program, graph_hash: str | None = None) -> None:
        """Cache ``program`` (compiled from the graph of ``graph_hash``, when given); the least
        recently used programs go past the cache's limits (their bytes: constants and kernels)."""
        if graph_hash:
            self.graph_keys[graph_hash] = program.key
        self.programs.put(program.key, program, program_bytes(program))

    def _forget_graphs(self, key: str, program) -> None:
        for ghash in [g for g, k in list(self.graph_keys.items()) if k == key]:
            self.graph_keys.pop(ghash, None)


def parse_run_request(request) -> tuple[list, list[int]]:
    """``(inputs, keep)`` of a run request (see ``exposed_run``), every field checked: inputs are
    client slot ids, ``"held"`` or ``{"resident": id}``; keep is distinct output positions."""
    if isinstance(request, list):
        request = {"inputs": request}
    if not isinstance(request, dict) or set(request) - {"inputs", "keep"} or not isinstance(request.get("inputs"), list):
        raise ValueError('a run names {"inputs": [...], "keep": [...]} or a list of slots')
    items, keep = request["inputs"], request.get("keep", [])
    for item in items:
        ok = (type(item) is int and 0 <= item < OUTPUT_SLOTS) or (type(item) is str and item == "held") or (
            type(item) is dict and list(item) == ["resident"] and type(item["resident"]) is int)
        if not ok:
            raise ValueError('inputs must be client slot ids, "held" or {"resident": id}')
    if not isinstance(keep, list) or not all(type(i) is int and 0 <= i for i in keep) or len(set(keep)) != len(keep):
        raise ValueError("keep must be a list of distinct output positions")
    return items, sorted(keep)


def program_bytes(program) -> int:
    """Host memory a cached program holds: its constants and kernel sources (graphs by their JSON)."""
    if program.kind == "graph":
        return len(json.dumps(program.graph or {}))
    return sum(len(b.data or b"") for b in program.buffers) + sum(len(k.wgsl) for k in program.kernels)


def _str(value, name: str) -> str:
    # rpyc would hand us a netref for anything that is not a plain value; never touch those.
    if type(value) is not str:
        raise TypeError(f"{name} must be a str")
    return value


def announcement(device: Device) -> list[str]:
    """Registry aliases of a device: ``TAPML`` and ``TAPML-<base32 JSON>`` carrying its platform,
    adapter, backend and features (base32 because the registry upper-cases names; the full caps
    come from the device itself, over an authenticated connection)."""
    import base64
    info = {"platform": device.spec}
    if device._caps is not None:
        info.update({k: device._caps.get(k) for k in ("adapter", "backend", "features")})
    text = json.dumps(info, separators=(",", ":"))
    if len(text) > 600:  # the registry takes one UDP datagram per registration
        text = json.dumps({"platform": device.spec[:100], "adapter": str(info.get("adapter"))[:200]})
    return [SERVICE_NAME, f"{SERVICE_NAME}-" + base64.b32encode(text.encode()).decode()]


def parse_announcement(name: str) -> dict | None:
    """Inverse of :func:`announcement` for one alias; None when it is not one, or when a field
    has the wrong type (:func:`~tapml.remote.announcement.check_announcement`)."""
    import base64
    if not name.upper().startswith(f"{SERVICE_NAME}-"):
        return None
    try:
        info = json.loads(base64.b32decode(name[len(SERVICE_NAME) + 1:].upper()).decode())
    except (ValueError, UnicodeDecodeError):
        return None
    from tapml.remote.announcement import check_announcement
    return check_announcement(info)


def make_service(device: Device):
    """The rpyc Service class for ``device``: one instance (and ConnectionState) per connection."""
    import rpyc

    from tapml.graph import Graph, Node, TensorMeta
    from tapml.platforms.base import KernelProgram

    class DeviceService(rpyc.Service):
        ALIASES = [SERVICE_NAME]  # serve() adds the announcement once the caps are known

        def on_connect(self, conn):
            self.session = ConnectionState(device.limits.max_buffer_bytes)
            device.sessions[self.session.id] = self.session

        def on_disconnect(self, conn):
            device.sessions.pop(self.session.id, None)
            self.session.close()

        def exposed_hello(self) -> str:
            """Protocol version, platform spec, caps, size limit and the bulk session id (JSON)."""
            try:
                return json.dumps(device.info(self.session))
            except Exception as e:  # noqa: BLE001 - the client reports it
                return _error_of(e)

        def exposed_stats(self) -> str:
            """Counters (JSON): programs compiled, programs cached, runs, open sessions, device
            workers restarted (after a timeout or a crash)."""
            return json.dumps({"compiled": device.compiled, "cached": len(device.programs), "runs": device.runs,
                               "sessions": len(device.sessions),
                               "worker_restarts": getattr(device.platform, "restarts", 0)})

        def exposed_ping(self) -> None:
            """Nothing: measures the round trip."""

        def exposed_supports(self, node_json) -> str:
            """Whether the platform can run the node (JSON): ``{"reason": null}`` when it can,
            ``{"reason": why}`` when it cannot, ``{"error": {kind, message}}`` when the device
            failed to answer (a fault, such as a worker that died: never a reason)."""
            try:
                raw = parse_request(_str(node_json, "node_json"), device.limits)
                check_node(raw if isinstance(raw, dict) else {})
                node = Node.from_json(raw)
            except (TypeError, ValueError, KeyError) as e:
                return json.dumps({"reason": f"malformed node: {e}"})
            except Unsupported as e:
                return json.dumps({"reason": str(e)})
            try:
                with device.exclusive():
                    return json.dumps({"reason": device.platform.supports(node) or None})
            except Unsupported as e:
                return json.dumps({"reason": str(e)})
            except Exception as e:  # noqa: BLE001 - the client reports it as an error, not a reason
                return _error_of(e)

        def exposed_compile(self, graph_json) -> str:
            """Compile a graph (JSON); returns ``{"key", "program"}`` or ``{"error": {kind, message}}``."""
            try:
                text = _str(graph_json, "graph_json")
                ghash = _hash(text)
                program = device.program(graph_hash=ghash)
                if program is not None:
                    return json.dumps({"key": program.key, "program": program.to_json()})
                raw = parse_request(text, device.limits)
                check_ops_json(raw)
                graph = Graph.from_json(raw)
                check_graph(graph, device.limits)
                with device.exclusive():
                    program = device.platform.compile(graph)
                    device.compiled += 1
                check_program(program, device.limits, device.program_kind)
                device.remember(program, ghash)
                return json.dumps({"key": program.key, "program": program.to_json()})
            except (TypeError, ValueError, KeyError) as e:
                return _error("usage", f"malformed graph: {type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001 - becomes the case's verdict
                return _error_of(e)

        def exposed_load(self, program_json) -> str:
            """Cache a program compiled elsewhere (JSON); returns ``{"key"}`` or an error."""
            try:
                raw = parse_request(_str(program_json, "program_json"), device.limits)
                check_ops_json(raw.get("graph") if isinstance(raw, dict) else None)
                program = KernelProgram.from_json(raw)
                check_program(program, device.limits, device.program_kind)
            except (TypeError, ValueError, KeyError, AttributeError) as e:
                return _error("usage", f"malformed program: {type(e).__name__}: {e}")
            except Unsupported as e:
                return _error_of(e)
            device.remember(program)
            return json.dumps({"key": program.key})

        def exposed_run(self, key, slots_json) -> str:
            """Run cached program ``key``. ``slots_json`` is a JSON list of input slots, or
            ``{"inputs": [...], "keep": [output positions]}`` whose inputs are each a slot, ``"held"``
            (the tensor this connection sent for that input of this program last time) or
            ``{"resident": id}`` (an output a run of this connection kept on the device). Returns
            ``{"outputs": [[slot | null, meta], ...], "resident": [[position, id], ...], "device_ms"}``
            (kept outputs have no slot) or an error."""
            from tapml.platforms.base import ResidentTensor
            try:
                key = _str(key, "key")
                items, keep = parse_run_request(parse_request(_str(slots_json, "slots_json"), device.limits))
            except (TypeError, ValueError, LimitExceeded) as e:
                return _error("usage", str(e))
            session = self.session
            try:
                tensors = session.take([s for s in items if type(s) is int], device.timeout)
            except PlatformError as e:
                return _error_of(e)
            program = device.program(key)
            if program is None:
                return _error("unknown-program", f"program {key} is not cached on this server")
            try:
                if any(i >= len(program.outputs) for i in keep):
                    raise ValueError(f"keep names outputs past the program's {len(program.outputs)}")
                args = session.run_args(key, items, tensors, len(program.inputs))
                session.check_keep(program, keep)
            except NotHeld as e:
                return _error(e.kind, str(e))
            except ValueError as e:
                return _error("usage", str(e))
            except Unsupported as e:
                return _error_of(e)
            resident = keep or any(isinstance(a, ResidentTensor) for a in args)
            try:
                with device.exclusive():
                    device.runs += 1
                    outputs = device.platform.run(program, args, keep=keep) if resident \
                        else device.platform.run(program, args)
                    ms = getattr(device.platform, "last_run_ms", None)
            except Exception as e:  # noqa: BLE001 - becomes the case's verdict
                # what the program held is unknown after a failed run: the client sends it all again
                session.held.pop(key)
                session.forget_kept(key, len(program.outputs))
                return _error("platform", str(e)) if isinstance(e, ValueError) else _error_of(e)
            ids = session.after_run(program, args, keep, outputs)
            reply = []
            try:
                for i, t in enumerate(outputs):
                    reply.append([None, program.output_meta[i].to_json()] if i in keep else
                                 [session.store(t), TensorMeta.of(t).to_json()])
            except LimitExceeded as e:  # the outputs stored so far go too: the client gets none of them
                with session.cond:
                    for slot, _ in reply:
                        if slot is not None:
                            session.pop(slot)
                return _error_of(e)
            return json.dumps({"outputs": reply, "resident": ids, "device_ms": ms})

        def exposed_read(self, resident_id) -> str:
            """Download a resident tensor (by the id a run gave it): ``{"outputs": [[slot, meta]]}``
            (fetch the slot over the bulk connection) or an error."""
            if type(resident_id) is not int:
                return _error("usage", "resident_id must be an int")
            handle = self.session.resident.get(resident_id)
            if handle is None:
                return _error("unknown-resident", f"resident tensor {resident_id} is not held for this connection")
            try:
                with device.exclusive():
                    t = device.platform.read(handle)
            except Exception as e:  # noqa: BLE001 - the client reports it
                return _error_of(e)
            try:
                return json.dumps({"outputs": [[self.session.store(t), TensorMeta.of(t).to_json()]]})
            except LimitExceeded as e:
                return _error_of(e)

        def exposed_free(self, slots_json) -> None:
            """Drop tensors the client will not download."""
            slots = parse_request(_str(slots_json, "slots_json"), device.limits)
            with self.session.cond:
                for s in slots if isinstance(slots, list) else []:
                    if type(s) is int:
                        self.session.pop(s)

        def exposed_bench_tensor(self, nbytes) -> int:
            """Create a float32 tensor of ``nbytes`` in a slot, for download benchmarks."""
            import torch
            if type(nbytes) is not int or not 0 < nbytes <= device.max_message or nbytes % 4:
                raise ValueError("nbytes must be a positive multiple of 4 within the message limit")
            self.session.reserve(nbytes, "a benchmark tensor")  # refused before it is made
            try:
                tensor = torch.ones(nbytes // 4, dtype=torch.float32)
            except BaseException:
                self.session.release(nbytes)
                raise
            return self.session.store(tensor, reserved=True)

    return DeviceService


def serve_bulk(device: Device, link: P.Link, peer) -> None:
    """Serve one authenticated bulk connection until it closes."""
    kind, _, _, _, payload = link.recv(64)
    session = device.sessions.get(bytes(payload)) if kind == P.SESS else None
    if session is None:
        link.send_error("unknown session: open the control connection first")
        return
    session.sockets.append(link.sock)
    link.send(P.ACK)
    try:
        while True:
            try:
                kind, slot, dtype, shape, nbytes = link.recv_header(device.max_message)
            except P.ProtocolError as e:
                log.warning("%s: %s", peer, e)
                session.fail(str(e))
                link.send_error(str(e))
                return
            if kind in (P.PUT, P.PUTA):
                try:
                    session.reserve(nbytes)  # before a byte of the payload is read
                except LimitExceeded as e:
                    log.warning("%s: %s", peer, e)
                    session.fail(str(e))
                    link.send_error(str(e), slot)
                    _drain(link.sock, nbytes + P.MAC)  # so the client reads the reason, not a reset
                    return
                try:
                    tensor = P.tensor_from(dtype, shape, link.recv_payload(nbytes))
                except P.ProtocolError as e:
                    session.release(nbytes)
                    session.fail(str(e))
                    link.send_error(str(e), slot)
                    return
                except BaseException:
                    session.release(nbytes)
                    raise
                if slot >= OUTPUT_SLOTS:
                    session.release(nbytes)
                    link.send_error(f"slot {slot} is reserved for outputs", slot)
                    return
                session.put(slot, tensor)
                if kind == P.PUTA:
                    link.send(P.ACK, slot)
            elif kind in (P.GET, P.GETK):
                link.recv_payload(nbytes)
                with session.cond:
                    tensor = session.slots.get(slot) if kind == P.GETK else session.pop(slot)
                if tensor is None:
                    link.send_error(f"no tensor in slot {slot}", slot)
                else:
                    link.send_tensor(P.TENSOR, slot, tensor)
            else:
                link.send_error(f"unknown message kind {kind!r}")
                return
    finally:
        if link.sock in session.sockets:
            session.sockets.remove(link.sock)


RAW_CHUNK = 1 << 20


def _drain(sock: socket.socket, nbytes: int, linger: float = 2.0) -> None:
    """Read and drop up to ``nbytes`` the peer is still sending (at most ``linger`` seconds), after
    an answer that refuses them: closing with them unread would reset the connection and lose it."""
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + linger
        scratch = bytearray(RAW_CHUNK)
        while nbytes > 0 and time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            got = sock.recv_into(scratch, min(nbytes, RAW_CHUNK))
            if not got:
                break
            nbytes -= got
    except OSError:
        pass


def serve_raw(device: Device, link: P.Link) -> None:
    """The benchmark's baseline: an authenticated socket that sinks or sources bytes, framed and
    tagged as bulk messages are, and nothing else. It holds one chunk of memory whatever sizes
    are asked for: ``SINK`` (payload: n bytes) is answered ``ACK``, ``SOURCE`` (slot: n) with a
    message of n zero bytes, ``PING`` with ``ACK``."""
    chunk = memoryview(bytearray(RAW_CHUNK))
    while True:
        kind, n, _, _, nbytes = link.recv_header(device.max_message)
        if kind == P.SINK:
            link.recv_through(nbytes, chunk)
            link.send(P.ACK)
        elif kind in (P.SOURCE, P.PING):
            link.recv_payload(nbytes)
            if kind == P.PING:
                link.send(P.ACK)
            elif n > device.max_message:
                link.send_error(f"{n} bytes exceed the message limit of {device.max_message}")
            else:
                link.send_repeated(P.TENSOR, n, chunk)
        else:
            return


class AuthGate:
    """Bounds unauthenticated work and slows token guessing.

    At most ``per_host`` handshakes from one address (``total`` from all) are in progress at
    once; more are refused at once, before their answer is read. A handshake that fails holds
    its place until the address's next free turn: turns are ``delay`` apart, doubling with each
    recent failure up to ``max_delay``, so guesses from one address come at most
    ``1/max_delay`` per second however many connections carry them. Failures also take turns of
    the whole server (``server_delay`` doubling up to ``server_max_delay``), so guesses from many
    addresses come at most ``1/server_max_delay`` per second in all. A correct answer is never
    delayed. Failures are forgotten ``forget`` seconds after the last one.
    """

    def __init__(self, per_host: int = 32, total: int = 256, delay: float = 0.05, max_delay: float = 1.0,
                 forget: float = 60.0, server_delay: float = 0.01, server_max_delay: float = 0.25):
        self.per_host, self.total = per_host, total
        self.delay, self.max_delay, self.forget = delay, max_delay, forget
        self.server_delay, self.server_max_delay = server_delay, server_max_delay
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._failures: dict[str, tuple[int, float, float]] = {}  # host -> (count, last failure, next turn)
        self._server = (0, 0.0, 0.0)  # the same over every address: loopback alone offers 2**24 of them

    def enter(self, host: str) -> str | None:
        """Take a place for a handshake from ``host``; the refusal reason when there is none."""
        with self._lock:
            if sum(self._pending.values()) >= self.total:
                return "too many connections are authenticating; retry in a moment"
            if self._pending.get(host, 0) >= self.per_host:
                return "too many connections from your address are authenticating; retry in a moment"
            self._pending[host] = self._pending.get(host, 0) + 1
            return None

    def leave(self, host: str) -> None:
        with self._lock:
            left = self._pending.get(host, 1) - 1
            if left > 0:
                self._pending[host] = left
            else:
                self._pending.pop(host, None)

    def pace(self, host: str, ok: bool) -> None:
        """Called with the handshake's outcome before it is answered: a failure waits its turn."""
        if ok:
            return
        with self._lock:
            now = time.monotonic()
            count, last, turn = self._failures.get(host, (0, now, now))
            if now - last > self.forget:
                count, turn = 0, now
            count += 1
            turn = max(turn, now) + min(self.delay * 2 ** (count - 1), self.max_delay)
            self._failures[host] = (count, now, turn)
            every, last_any, turn_any = self._server
            if now - last_any > self.forget:
                every, turn_any = 0, now
            every += 1
            turn_any = max(turn_any, now) + min(self.server_delay * 2 ** min(every - 1, 60), self.server_max_delay)
            self._server = (every, now, turn_any)
            turn = max(turn, turn_any)
            if len(self._failures) > 4096:  # forget the oldest addresses first
                for old in sorted(self._failures, key=lambda h: self._failures[h][1])[:1024]:
                    del self._failures[old]
        time.sleep(max(0.0, turn - now))


def make_server(device: Device, host: str, port: int, token: str | None, registrar=None,
                auth_timeout: float = P.AUTH_TIMEOUT_S):
    """A rpyc ThreadedServer for ``device`` whose connections must pass the handshake first."""
    from rpyc.core.stream import SocketStream
    from rpyc.utils.authenticators import AuthenticationError
    from rpyc.utils.server import ThreadedServer

    gate = AuthGate()

    def authenticate(sock):
        peer = _peer(sock)
        host = peer.rpartition(":")[0]
        P.tune(sock)
        busy = gate.enter(host)
        if busy:
            log.warning("refused %s: %s", peer, busy)
            P.refuse(sock, busy)
            raise AuthenticationError(busy)
        try:
            auth = P.server_handshake(sock, token, auth_timeout, pace=lambda ok: gate.pace(host, ok),
                                      server_id=bytes.fromhex(device.server_id))
        except P.AuthError as e:
            log.warning("refused %s: %s", peer, e)
            raise AuthenticationError(str(e)) from None
        finally:
            gate.leave(host)
        return sock, auth

    class DeviceServer(ThreadedServer):
        def accept(self):
            # rpyc ends the server on any accept() error; running out of file descriptors or
            # memory for a moment (a flood of connections) must not stop the device.
            try:
                return super().accept()
            except EOFError:
                if not self.active:
                    raise
                log.warning("accept failed (too many connections?); retrying")
                time.sleep(0.1)

        def _serve_client(self, sock, auth):
            peer = _peer(sock)
            try:
                if auth.role == "bulk":
                    serve_bulk(device, P.Link(sock, auth), peer)
                elif auth.role == "raw":
                    serve_raw(device, P.Link(sock, auth))
                else:
                    config = dict(self.protocol_config, credentials=None, logger=self.logger,
                                  endpoints=(sock.getsockname(), sock.getpeername()))
                    channel = P.limited_channel(SocketStream(sock), device.limits.max_request_bytes, auth,
                                                on_refuse=lambda reason: log.warning("%s: %s", peer, reason))
                    self.service._connect(channel, config).serve_all()
            except (EOFError, OSError, P.ProtocolError) as e:
                log.info("%s disconnected: %s", peer, e)

    quiet = logging.getLogger("tapml.serve.rpyc")
    quiet.setLevel(logging.CRITICAL)
    return DeviceServer(make_service(device), hostname=host, port=port, authenticator=authenticate,
                        registrar=registrar, auto_register=registrar is not None, logger=quiet,
                        protocol_config={"allow_pickle": False, "allow_public_attrs": False,
                                         "allow_all_attrs": False, "allow_setattr": False,
                                         "allow_delattr": False, "include_local_traceback": False,
                                         "include_local_version": False, "import_custom_exceptions": False,
                                         "instantiate_custom_exceptions": False,
                                         "sync_request_timeout": device.timeout})


def _peer(sock) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


def is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_registry(spec: str) -> tuple[str, str, int]:
    """``[udp://|tcp://]HOST[:PORT]`` -> (mode, host, port); TapmlError says what is wrong."""
    from rpyc.utils.registry import REGISTRY_PORT
    m = re.fullmatch(r"(?:(udp|tcp)://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+)(?::(\d{1,5}))?", spec or "")
    if not m or (m.group(3) and not 0 < int(m.group(3)) < 65536):
        raise TapmlError(f"bad registry {spec!r}; expected [udp://|tcp://]HOST[:PORT], e.g. udp://127.0.0.1:{REGISTRY_PORT}")
    return m.group(1) or "udp", m.group(2).strip("[]"), int(m.group(3) or REGISTRY_PORT)


def registry_client(spec: str, timeout: float = 2.0):
    """An rpyc registry client for a ``[udp://|tcp://]HOST[:PORT]`` spec."""
    from rpyc.utils.registry import TCPRegistryClient, UDPRegistryClient
    mode, host, port = parse_registry(spec)
    quiet = logging.getLogger("tapml.registry")
    quiet.setLevel(logging.CRITICAL)
    if mode == "tcp":
        return TCPRegistryClient(host, port=port, timeout=timeout, logger=quiet)
    return UDPRegistryClient(ip=host, port=port, timeout=timeout, logger=quiet)


def _report_registrations(registrar, on_register) -> None:
    """Make ``registrar.register`` (called every few seconds by rpyc's announcing thread) call
    ``on_register(ok)`` when its outcome changes, the first one included."""
    register, last = registrar.register, []

    def reporting(*args, **kwargs):
        ok = False
        try:
            ok = bool(register(*args, **kwargs))
            return ok
        finally:
            if last != [ok]:
                last[:] = [ok]
                on_register(ok)
    registrar.register = reporting


def serve(platform, spec: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, token: str | None = None,
          max_message: int = DEFAULT_MAX_MESSAGE, register: str | None = None, timeout: float = 300.0,
          on_listen=None, lazy_caps: bool = False, auth_timeout: float = P.AUTH_TIMEOUT_S,
          limits: ServerLimits | None = None, on_stop=None, on_register=None) -> None:
    """Serve ``platform`` until SIGTERM/SIGINT. ``on_listen(host, port)`` runs once the port accepts.
    ``lazy_caps``: ask the platform for its caps only when a client does (a browser page that
    nobody has opened yet has none). ``limits``: what one request may cost (defaults of
    :class:`ServerLimits`). After a signal the process exits within ``STOP_GRACE_S`` seconds even
    when a device call does not return: then ``on_stop()`` runs (release the device) and the
    process ends with ``os._exit(0)``. ``on_register(ok)`` runs when an announcement to the
    registry first succeeds and whenever it turns from answered to unanswered or back."""
    device = Device(platform, spec, max_message=max_message, timeout=timeout, limits=limits)
    if not lazy_caps:
        device.caps  # noqa: B018 - fail before listening when the device cannot say what it is
    registrar = registry_client(register) if register else None
    if registrar is not None and on_register is not None:
        _report_registrations(registrar, on_register)
    try:
        server = make_server(device, host, port, token, registrar, auth_timeout)
    except OSError as e:
        raise TapmlError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port "
                         "(0 picks a free one)") from None
    server._listen()  # listen before announcing the port: clients may connect at once
    stop = threading.Event()

    def force_exit():
        time.sleep(STOP_GRACE_S)
        # Still here: a device call in native code holds the process (or its shutdown); end it.
        try:
            if on_stop:  # in a thread of its own: releasing the device may block as well
                releasing = threading.Thread(target=on_stop, daemon=True)
                releasing.start()
                releasing.join(STOP_GRACE_S)
            os.write(1, b"tapml serve: stopped (device call abandoned)\n")
        finally:
            os._exit(0)

    def on_signal(signum, frame):
        if not stop.is_set():
            threading.Thread(target=force_exit, name="tapml-stop-watchdog", daemon=True).start()
        stop.set()
        server.close()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if on_listen:
            on_listen(server.host, server.port)
        server.service.ALIASES = announcement(device)  # caps are known once announced
        if not stop.is_set():
            server.start()
    except OSError:
        if not stop.is_set():  # a signal between announcing and start() closes the listener early
            raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        server.close()
        for session in list(device.sessions.values()):
            session.close()
        # Connection threads (daemons) still winding down must not write to stderr while the
        # interpreter shuts down: that can abort the process (SIGABRT) instead of exiting 0.
        log.disabled = True
