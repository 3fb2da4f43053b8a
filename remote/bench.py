"""Transport benchmark: tensor upload/download and empty-call latency of a device server,
next to a plain socket to the same server measured in the same run.

The baseline is the server's ``raw`` endpoint: after the handshake it is a TCP socket that
receives n bytes (then answers) or sends n bytes, framed and tagged (HMAC-SHA256 under the
session key) as tensors are, with the same socket options as the tensor path: the floor of an
authenticated transfer, so the ratios measure what tensors, slots and rpyc add to it. Both paths are measured alternately, best of
``repeat``, so load from other processes hits them alike.
"""

from __future__ import annotations

import time

from tapml.remote import protocol as P

#: Bound per ratio: the throughput ratios must reach theirs, empty calls stay below theirs.
GOALS = {"upload_vs_socket": 0.7, "download_vs_socket": 0.7, "empty_call_ms": 0.3}
GOAL_OPS = {"upload_vs_socket": ">=", "download_vs_socket": ">=", "empty_call_ms": "<"}


def goal_met(key: str, value: float | None) -> bool | None:
    """Whether ``value`` of ratio ``key`` meets its goal in :data:`GOALS`; None without a value."""
    if value is None:
        return None
    return value < GOALS[key] if GOAL_OPS[key] == "<" else value >= GOALS[key]


def _timed(fn) -> tuple[float, object]:
    """``(seconds, result)`` of one call of ``fn``."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure_transport(platform, size_bytes: int = 64 << 20, repeat: int = 10, calls: int = 2000) -> dict:
    """Measure ``platform`` (a :class:`~tapml.remote.client.RemotePlatform`); returns the report
    dict with ``socket``, ``tensor``, ``empty_call_ms`` and ``ratios``
    (``upload_vs_socket``, ``download_vs_socket``, ``empty_call_ms``)."""
    import torch
    if size_bytes <= 0 or size_bytes % 4:
        raise ValueError("size_bytes must be a positive multiple of 4")
    limit = platform.info.get("max_message", size_bytes)
    if size_bytes > limit:
        raise ValueError(f"{size_bytes} bytes exceed the server's message limit of {limit}; "
                         "restart it with a larger --max-message-mib or bench a smaller --size-mib")
    tensor = torch.rand(size_bytes // 4, dtype=torch.float32)
    payload = P.tensor_bytes(tensor)[2]
    raw = platform.raw_socket()
    try:
        def raw_up():
            raw.send(P.SINK, 0, payload)
            raw.recv(64)

        def raw_down():
            raw.send(P.SOURCE, size_bytes)
            raw.recv(size_bytes)

        def raw_ping():
            raw.send(P.PING)
            raw.recv(64)

        down_slot = platform.bench_tensor(size_bytes)
        times = {k: [] for k in ("socket_up", "socket_down", "tensor_up", "tensor_down", "socket_rtt", "call")}
        n = max(1, calls // repeat)
        for _ in range(repeat):
            times["socket_up"].append(_timed(raw_up)[0])
            seconds, slot = _timed(lambda: platform.upload(tensor))
            times["tensor_up"].append(seconds)
            platform.free([slot])
            times["socket_down"].append(_timed(raw_down)[0])
            seconds, got = _timed(lambda: platform.download(down_slot, keep=True))
            times["tensor_down"].append(seconds)
            if got.nbytes != size_bytes:
                raise RuntimeError(f"downloaded {got.nbytes} bytes, expected {size_bytes}")
            del got
            times["socket_rtt"].append(_timed(lambda: [raw_ping() for _ in range(n)])[0] / n)
            times["call"].append(_timed(lambda: [platform.ping() for _ in range(n)])[0] / n)
        platform.free([down_slot])
    finally:
        raw.close()
    mbps = {k: size_bytes / min(v) / 1e6 for k, v in times.items() if k in ("socket_up", "socket_down", "tensor_up", "tensor_down")}
    report = {
        "target": platform.name, "platform": platform.info.get("platform"), "size_bytes": size_bytes,
        "repeat": repeat, "calls": n * repeat, "statistic": "best of repeat",
        "socket": {"upload_MBps": round(mbps["socket_up"], 1), "download_MBps": round(mbps["socket_down"], 1),
                   "round_trip_ms": round(min(times["socket_rtt"]) * 1e3, 4)},
        "tensor": {"upload_MBps": round(mbps["tensor_up"], 1), "download_MBps": round(mbps["tensor_down"], 1)},
        "empty_call_ms": round(min(times["call"]) * 1e3, 4),
    }
    report["ratios"] = {"upload_vs_socket": round(mbps["tensor_up"] / mbps["socket_up"], 3),
                        "download_vs_socket": round(mbps["tensor_down"] / mbps["socket_down"], 3),
                        "empty_call_ms": report["empty_call_ms"]}
    report["goals"] = dict(GOALS)
    report["passed"] = all(goal_met(k, report["ratios"][k]) for k in GOALS)
    return report
