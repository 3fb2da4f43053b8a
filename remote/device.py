"""The device a server exposes (:class:`Device`): its platform, its limits, the one lock that
serializes device calls, the program cache shared by every connection and the open connections.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import TYPE_CHECKING

from tapml.errors import PlatformError
from tapml.remote import protocol as P
from tapml.remote.limits import ServerLimits

if TYPE_CHECKING:
    from tapml.remote.connection import ConnectionState

PROTOCOL_VERSION = P.PROTOCOL_VERSION
DEFAULT_MAX_MESSAGE = 1 << 30


class DeviceBusy(PlatformError):
    """Another client held the device for longer than a request may wait for it."""


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


def program_bytes(program) -> int:
    """Host memory a cached program holds: its constants and kernel sources (graphs by their JSON)."""
    if program.kind == "graph":
        return len(json.dumps(program.graph or {}))
    return sum(len(b.data or b"") for b in program.buffers) + sum(len(k.wgsl) for k in program.kernels)
