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

This module is the server process: the listener and the handshake gate in front of it
(:func:`make_server`, :class:`AuthGate`) and the lifecycle (:func:`serve`: announce, serve,
stop on SIGTERM/SIGINT). What a connection is served lives beside it: the control connection's
rpyc service in :mod:`tapml.remote.service`, the bulk connections in :mod:`tapml.remote.bulk`,
one client's state in :mod:`tapml.remote.connection`, the device they share in
:mod:`tapml.remote.device`, the registry announcement in :mod:`tapml.remote.announcement`.
Their public names are importable from here too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from tapml.errors import TapmlError
from tapml.remote import protocol as P
from tapml.remote.announcement import (SERVICE_NAME, announcement, parse_announcement, parse_registry,
                                       registry_client)
from tapml.remote.bulk import RAW_CHUNK, serve_bulk, serve_raw
from tapml.remote.connection import MAX_RESIDENT, OUTPUT_SLOTS, ConnectionState, NotHeld, parse_run_request
from tapml.remote.device import DEFAULT_MAX_MESSAGE, PROTOCOL_VERSION, Device, DeviceBusy, program_bytes
from tapml.remote.limits import ServerLimits
from tapml.remote.service import make_service

DEFAULT_PORT = 18861
STOP_GRACE_S = 3.0  # after SIGTERM/SIGINT, the process exits this soon whatever is still running

log = logging.getLogger("tapml.serve")


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


__all__ = ["serve", "make_server", "AuthGate", "is_loopback", "DEFAULT_PORT", "STOP_GRACE_S",
           # re-exported from the modules that hold them
           "SERVICE_NAME", "announcement", "parse_announcement", "parse_registry", "registry_client", "RAW_CHUNK",
           "serve_bulk", "serve_raw", "MAX_RESIDENT", "OUTPUT_SLOTS", "ConnectionState", "NotHeld", "parse_run_request",
           "DEFAULT_MAX_MESSAGE", "PROTOCOL_VERSION", "Device", "DeviceBusy", "program_bytes", "make_service"]
