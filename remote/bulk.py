"""The bulk connections beside a control connection: :func:`serve_bulk` moves tensors into and
out of the connection's slots as framed, authenticated messages (:mod:`tapml.remote.protocol`),
each upload admitted against the connection's limits before a byte of it is read;
:func:`serve_raw` is the transport benchmark's baseline, a socket that only sinks and sources bytes.
"""

from __future__ import annotations

import logging
import socket
import time

from tapml.remote import protocol as P
from tapml.remote.connection import OUTPUT_SLOTS
from tapml.remote.device import Device
from tapml.remote.limits import LimitExceeded

log = logging.getLogger("tapml.serve")


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
