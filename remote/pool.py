"""``registry://HOST:PORT[?platform=P]`` targets: every live device server announced to a
``tapml registry``, used as one pool.

The registry is asked (UDP by default, as ``tapml registry`` runs; ``&mode=tcp`` for a TCP
registry) which servers announced ``TAPML``; the pool opens a
:class:`~tapml.remote.client.RemotePlatform` on each and keeps those that answer, serve the
platform asked for (what the server says after authentication, not what anyone announced)
and accept their token. The registry is unauthenticated: it only says where to knock.

:meth:`DevicePool.map` spreads work over the devices, a thread per device: an item whose device
is lost (DeviceLost: killed, unreachable, no reply within the call timeout) goes back to the
queue for another device, and every item gets exactly one result. A device that fails
``max_failures`` times in a row is taken out of the pool with its reason. When every device is
gone the registry is asked again (a restarted registry learns servers back as they re-announce);
the pool never needs the registry after it opened otherwise.

Tokens: one string for every server, or a token map ``{"HOST:PORT": token, "*": fallback}``
read from a JSON file by :func:`read_token_map`.

Example::

    with DevicePool("registry://127.0.0.1:18811", token="s3cret") as pool:
        results = pool.map(cases, lambda platform, case: run_case(platform, store, case))
        [target for _, target in results]  # which device ran each case
"""

from __future__ import annotations

import collections
import json
import socket
import threading
import time
from typing import Callable

from tapml.errors import DeviceLost, TapmlError
from tapml.platforms.base import Platform
from tapml.platforms.targets import RegistryTarget, parse_registry_target, token_for

#: Consecutive failures after which a device leaves the pool.
MAX_FAILURES = 3
#: The registry's reply is one datagram of at most this many bytes (rpyc's limit): about 50 servers.
REGISTRY_REPLY_BYTES = 1500
MAX_TOKEN_MAP_BYTES = 1 << 20

__all__ = ["DevicePool", "PoolDevice", "PoolPlatform", "discover", "is_pool_target", "read_token_map", "token_for"]


def is_pool_target(spec) -> bool:
    """Whether a TARGET spec names a pool (``registry://...``)."""
    return isinstance(spec, str) and spec.startswith("registry://")


def read_token_map(path: str) -> dict[str, str]:
    """A token map from a JSON file: ``{"HOST:PORT": "token", ..., "*": "for any other server"}``.

    TapmlError saying what to fix when the file is missing, not JSON, or holds anything but
    non-empty string tokens under ``HOST:PORT`` (or ``*``) keys. Example file::

        {"10.0.0.5:18861": "phone-secret", "*": "lab-secret"}
    """
    import re
    from tapml.io import read_regular_file
    fix = 'write a JSON object such as {"127.0.0.1:18861": "token", "*": "token for any other server"}'
    raw = read_regular_file(path, f"--token-map {path}", fix, max_bytes=MAX_TOKEN_MAP_BYTES)
    try:
        data = json.loads(raw.decode(), parse_constant=lambda c: None)
    except (UnicodeDecodeError, ValueError) as e:
        raise TapmlError(f"--token-map {path} is not JSON ({str(e)[:120]}); {fix}") from None
    if not isinstance(data, dict) or not data:
        raise TapmlError(f"--token-map {path} is not a non-empty JSON object; {fix}")
    for key, token in data.items():
        if key != "*" and not re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):\d{1,5}", key):
            raise TapmlError(f"--token-map {path}: key {key[:80]!r} is not HOST:PORT or '*'; {fix}")
        if not isinstance(token, str) or not token.strip() or len(token) > 4096:
            raise TapmlError(f"--token-map {path}: the token of {key[:80]} is not a non-empty string; {fix}")
    return {key.replace("[", "").replace("]", ""): token.strip() for key, token in data.items()}


def discover(registry: RegistryTarget, timeout: float = 2.0, tries: int = 3) -> list[tuple[str, int]]:
    """The ``(host, port)`` of every server announced to ``registry``, sorted.

    UDP queries are sent ``tries`` times (a datagram can be lost); TapmlError when nothing
    listens there or it never answers."""
    from rpyc.core import brine
    from tapml.remote.server import SERVICE_NAME
    where = f"{registry.mode}://{registry.host}:{registry.port}"
    query = brine.dump(("RPYC", "QUERY", (SERVICE_NAME,)))
    reply, error = None, "no answer"
    for _ in range(max(1, tries)):
        kind = socket.SOCK_DGRAM if registry.mode == "udp" else socket.SOCK_STREAM
        try:
            family = socket.getaddrinfo(registry.host, registry.port, type=kind)[0][0]
            with socket.socket(family, kind) as sock:
                sock.settimeout(timeout)
                sock.connect((registry.host, registry.port))  # a connected UDP socket hears "refused"
                sock.send(query)
                reply = sock.recv(REGISTRY_REPLY_BYTES)
            break
        except ConnectionRefusedError:
            error = "nothing listens there"
        except (socket.timeout, TimeoutError):
            error = f"no answer within {timeout:g} s"
        except OSError as e:
            error = str(e.strerror or e)
    if reply is None:
        raise TapmlError(f"cannot reach the registry at {where}: {error}; start one with "
                         f"`tapml registry --port {registry.port}`"
                         + (" (add &mode=tcp for a TCP registry)" if registry.mode == "udp" else ""))
    try:
        servers = brine.load(reply)
    except Exception:  # noqa: BLE001 - a stranger's bytes; any decoding failure means "not a registry"
        servers = None
    if not isinstance(servers, tuple) or not all(
            isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], str) and len(s[0]) < 256
            and type(s[1]) is int and 0 < s[1] < 65536 for s in servers):
        raise TapmlError(f"the registry at {where} answered with something that is not a list of servers")
    return sorted(set(servers))


class PoolDevice:
    """One device server of a pool: its ``target`` (``remote://HOST:PORT``), the open
    ``platform`` (a RemotePlatform), what it said about itself (``info``), how many items it
    ``served``, its consecutive ``failures`` and, once out of the pool, the ``reason``."""

    def __init__(self, target: str, platform):
        self.target = target
        self.platform = platform
        self.info: dict = dict(getattr(platform, "info", {}) or {})
        self.served = 0
        self.failures = 0
        self.reason: str | None = None

    def describe(self) -> dict:
        caps = self.info.get("caps") or {}
        return {"target": self.target, "platform": self.info.get("platform", "?"), "adapter": caps.get("adapter", ""),
                "backend": caps.get("backend", ""), "served": self.served, "status": self.reason or "ok"}


class DevicePool:
    """The live device servers a ``registry://`` target names, opened and ready to share work.

    ``token``: None, one token for every server, or a token map (:func:`read_token_map`).
    ``max_failures``: consecutive failures after which a device leaves the pool. ``timeout`` /
    ``connect_timeout``: as for :class:`~tapml.remote.client.RemotePlatform`.

    Raises TapmlError (a usage error: exit 2) when the registry cannot be reached or no live
    device of the asked platform answers; the message lists each server and why it was left out.
    """

    def __init__(self, spec: str, token=None, *, max_failures: int = MAX_FAILURES, timeout: float | None = None,
                 connect_timeout: float = 10.0, registry_timeout: float = 2.0):
        self.spec = spec
        self.registry = parse_registry_target(spec)
        self.token = token
        self.max_failures = max_failures
        self.timeout, self.connect_timeout, self.registry_timeout = timeout, connect_timeout, registry_timeout
        self.devices: list[PoolDevice] = []
        #: target -> why it is not (or no longer) in the pool
        self.removed: dict[str, str] = {}
        self._retired: list[PoolDevice] = []
        self.last_refresh_error: str | None = None
        self._lock = threading.RLock()
        self.refresh()
        if not self.devices:
            left_out = "; ".join(f"{t}: {r}" for t, r in self.removed.items())
            kind = f" serving {self.registry.platform}" if self.registry.platform else ""
            raise TapmlError(f"no live device{kind} at {spec}" + (f" ({left_out})" if left_out else
                             " (no server announced itself)") + "; start one with `tapml serve --register "
                             f"{self.registry.mode}://{self.registry.host}:{self.registry.port}`")

    @property
    def targets(self) -> list[str]:
        """The live devices' targets, sorted."""
        return [d.target for d in self.devices]

    def refresh(self) -> int:
        """Ask the registry again and open the servers not yet in the pool (never one taken out);
        returns how many joined. A registry that is away changes nothing."""
        from tapml.remote.client import RemotePlatform
        try:
            addresses = discover(self.registry, self.registry_timeout)
        except TapmlError as e:
            if not self.devices and not self._retired:
                raise
            self.last_refresh_error = str(e)
            return 0
        joined = 0
        for host, port in addresses:
            target = f"remote://{f'[{host}]' if ':' in host else host}:{port}"
            with self._lock:
                if target in self.removed or any(d.target == target for d in self.devices):
                    continue
            try:
                platform = RemotePlatform(host, port, token=token_for(self.token, target), timeout=self.timeout,
                                          connect_timeout=self.connect_timeout)
            except TapmlError as e:
                self.removed[target] = str(e)
                continue
            served = platform.info.get("platform")
            if self.registry.platform and served != self.registry.platform:
                platform.close()
                self.removed[target] = f"serves {served}, not {self.registry.platform}"
                continue
            with self._lock:
                self.devices.append(PoolDevice(target, platform))
                self.devices.sort(key=lambda d: d.target)
            joined += 1
        return joined

    def remove(self, device: PoolDevice, reason: str) -> None:
        """Take ``device`` out of the pool for good, with ``reason``."""
        with self._lock:
            if device in self.devices:
                self.devices.remove(device)
                self._retired.append(device)
            device.reason = reason
            self.removed[device.target] = reason
        try:
            device.platform.close()
        except Exception:  # noqa: BLE001 - it is gone already
            pass

    def failed(self, device: PoolDevice, error: DeviceLost) -> bool:
        """Count a failure of ``device`` and try to reconnect it; False (and the device out of
        the pool) after ``max_failures`` in a row."""
        device.failures += 1
        if device.failures < self.max_failures:
            try:
                device.platform.reconnect()
                return True
            except DeviceLost as e:
                error = e  # counted with the next failure: the next call reconnects again
        if device.failures >= self.max_failures:
            self.remove(device, f"{device.failures} failures in a row, the last: {error}")
            return False
        return True

    def describe(self) -> list[dict]:
        """Every device that was in the pool (and each server left out), with what it served and its status."""
        with self._lock:
            rows = [d.describe() for d in sorted(self.devices + self._retired, key=lambda d: d.target)]
            known = {r["target"] for r in rows}
            rows += [{"target": t, "platform": "?", "adapter": "", "backend": "", "served": 0, "status": reason}
                     for t, reason in sorted(self.removed.items()) if t not in known]
        return rows

    def map(self, items: list, work: Callable, *, on_result: Callable | None = None,
            on_lost: Callable | None = None) -> list[tuple[object, str]]:
        """Run ``work(platform, item)`` for every item, spread over the pool's devices (a thread
        per device); returns ``[(result, target), ...]`` in the items' order.

        DeviceLost puts the item back for another device (an item lost on ``max_failures``
        different devices is given up: it would take the whole pool down); every item gets exactly one
        result. ``on_result(index, result, target)`` is called as results arrive, one at a time.
        Items left when every device is gone (and the registry has no new one) get
        ``on_lost(item, error)`` as their result, or DeviceLost is raised when it is None. Any
        other exception from ``work`` stops the run and is raised here."""
        items = list(items)
        pending = collections.deque(range(len(items)))
        results: list = [None] * len(items)
        lost_on: list[set[str]] = [set() for _ in items]
        given_up: dict[int, DeviceLost] = {}
        state = {"in_flight": 0, "error": None}
        cond = threading.Condition()

        def take(device: PoolDevice):
            with cond:
                while state["error"] is None and (pending or state["in_flight"]):
                    # an item this device lost goes to another; to this one only when it is the last
                    alone = [d for d in self.devices if d is not device] == []
                    i = next((i for i in pending if alone or device.target not in lost_on[i]), None)
                    if i is not None:
                        pending.remove(i)
                        state["in_flight"] += 1
                        return i
                    cond.wait(0.5)  # an item in flight on another device may come back
                return None

        def serve(device: PoolDevice) -> None:
            while (i := take(device)) is not None:
                try:
                    result = work(device.platform, items[i])
                except DeviceLost as e:
                    with cond:
                        lost_on[i].add(device.target)
                        if len(lost_on[i]) >= self.max_failures:
                            given_up[i] = e
                        else:
                            pending.appendleft(i)
                        state["in_flight"] -= 1
                        cond.notify_all()
                    if not self.failed(device, e):
                        return
                    continue
                except BaseException as e:  # noqa: BLE001 - re-raised by map()
                    with cond:
                        state["error"] = state["error"] or e
                        state["in_flight"] -= 1
                        cond.notify_all()
                    return
                with cond:
                    results[i] = (result, device.target)
                    device.served += 1
                    device.failures = 0
                    state["in_flight"] -= 1
                    if on_result:
                        on_result(i, result, device.target)
                    cond.notify_all()

        while pending and state["error"] is None:
            threads = [threading.Thread(target=serve, args=(d,), name=f"tapml-pool-{d.target}", daemon=True)
                       for d in list(self.devices)]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.5)  # in steps, so that Ctrl-C reaches the main thread
            if pending and state["error"] is None and not self.devices and not self.refresh():
                break
        if state["error"] is not None:
            raise state["error"]
        lost = sorted(given_up.items()) + [(i, None) for i in sorted(pending)]
        for i, error in lost:
            error = error or DeviceLost(f"every device of {self.spec} is gone: "
                                        + "; ".join(f"{t}: {r}" for t, r in sorted(self.removed.items())))
            if on_lost is None:
                raise error
            results[i] = (on_lost(items[i], error), "")
            if on_result:
                on_result(i, results[i][0], "")
        return results

    def close(self) -> None:
        """Close every device's connection. Safe to call twice."""
        for d in self.devices + self._retired:
            try:
                d.platform.close()
            except Exception:  # noqa: BLE001 - closing what may be gone
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PoolPlatform(Platform):
    """What ``open_target("registry://...")`` returns: a Platform that runs on the pool's first
    healthy device and, when :meth:`reconnect` follows a DeviceLost and that device is still
    gone, moves to the next one. ``pool`` (a :class:`DevicePool`) is there for the callers that
    spread work (``tapml replay``, ``tapml migrate``'s op stage).

    Example::

        with PoolPlatform("registry://127.0.0.1:18811", token="s3cret") as p:
            p.pool.targets  # ['remote://127.0.0.1:40001', 'remote://127.0.0.1:40002']
    """

    def __init__(self, spec: str, token=None, **options):
        self.name = spec
        self.pool = DevicePool(spec, token, **options)

    @property
    def device(self) -> PoolDevice:
        """The device single-device work runs on (DeviceLost when none is left)."""
        devices = self.pool.devices
        if not devices:
            raise DeviceLost(f"every device of {self.name} is gone: "
                             + "; ".join(f"{t}: {r}" for t, r in sorted(self.pool.removed.items())))
        return devices[0]

    def caps(self) -> dict:
        return self.device.platform.caps()

    def force_limits(self, limits: dict[str, int]) -> None:
        """Refused: each device of a pool compiles for its own caps, and devices join and leave."""
        raise ValueError("a registry:// pool cannot lower its devices' limits; give one device as remote://HOST:PORT")

    def supports(self, node):
        return self.device.platform.supports(node)

    def compile(self, graph):
        return self.device.platform.compile(graph)

    def run(self, program, inputs, keep=()):
        return self.device.platform.run(program, inputs, keep)

    def read(self, handle):
        return self.device.platform.read(handle)

    @property
    def last_run_ms(self):
        devices = self.pool.devices
        return getattr(devices[0].platform, "last_run_ms", None) if devices else None

    @property
    def upload_bytes(self) -> int:
        return sum(d.platform.upload_bytes for d in self.pool.devices)

    def enable_guards(self) -> bool:
        return False

    def reconnect(self) -> None:
        """Re-open the current device; when it stays gone, take it out and use the next one
        (the registry is asked again when none is left). DeviceLost when no device is left."""
        device = self.device
        try:
            device.platform.reconnect()
        except DeviceLost as e:
            self.pool.remove(device, f"lost and not back: {e}")
            if not self.pool.devices:
                self.pool.refresh()
            self.device  # noqa: B018 - DeviceLost when the pool is empty

    def close(self) -> None:
        self.pool.close()
