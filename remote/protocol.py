"""Wire protocol of the device server: authentication, size-limited framing, tensor transport.

Every TCP connection to ``tapml serve`` starts with a challenge-response handshake; what runs
after it depends on the *role* the client proved the token for:

``control``  an rpyc connection (JSON strings and small plain values; no pickle);
``bulk``     tensors as raw bytes with a small binary header, bound to one control session;
``raw``      a plain socket for the transport benchmark's baseline.

Handshake (the token never travels; both sides prove they hold it)::

    server -> client   MAGIC | flags (1: token required) | server nonce (32)
    client -> server   role (1) | client nonce (32) | HMAC(token, "client" | role | ns | nc)
    server -> client   "OK" | HMAC(token, "server" | role | nc | ns)
                   or  "NO" | u16 length | reason (utf-8), then close

Bulk messages (both directions)::

    kind (4) | slot (u64) | dtype code (u8) | ndim (u8) | nbytes (u64) | shape (ndim x u64) | payload
"""

from __future__ import annotations

import hashlib
import hmac
import math
import mmap
import os
import socket
import struct
import time

MAGIC = b"TAPML/1\n"
NONCE = 32
MAC = 32
ROLES = {b"C": "control", b"B": "bulk", b"R": "raw"}
ROLE_OF = {v: k for k, v in ROLES.items()}
AUTH_TIMEOUT_S = 10.0

# Wire codes are fixed forever: append, never reorder.
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
          "complex64")
DTYPE_CODE = {name: i for i, name in enumerate(DTYPES)}

HEADER = struct.Struct("!4sQBBQ")
MAX_NDIM = 64

# Bulk message kinds.
PUT = b"PUT "    # client -> server: store a tensor in a slot
PUTA = b"PUTA"   # same, then the server answers ACK (used to time uploads)
GET = b"GET "    # client -> server: send the tensor of a slot and free it
GETK = b"GETK"   # same, keeping it (benchmarks download one tensor many times)
SESS = b"SESS"   # client -> server, first bulk message: bind to a control session (payload: id)
TENSOR = b"TENS"  # server -> client: a tensor
ACK = b"ACK "
ERR = b"ERR "    # payload: utf-8 message
# Raw (baseline) connection: SINK n -> server reads n bytes, answers ACK; SOURCE n -> server sends n bytes.
SINK = b"SINK"
SOURCE = b"SRCE"
PING = b"PING"


class AuthError(Exception):
    """The peer failed the handshake (bad token, wrong protocol, timeout)."""


class ProtocolError(Exception):
    """The peer sent something the protocol does not allow (bad header, oversize message)."""


def tune(sock: socket.socket) -> socket.socket:
    """Small messages go out at once (no Nagle delay); dead peers are noticed by keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Read exactly n bytes; EOFError when the peer closes first. With ``deadline`` (a
    ``time.monotonic()`` value) the whole read must finish by then (TimeoutError otherwise)."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """:func:`recv_exact` into ``view`` (no copy)."""
    got, n = 0, len(view)
    while got < n:
        if deadline is not None:  # a per-recv timeout alone lets a peer trickle one byte at a time forever
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {got} of {n} bytes")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k


def _mac(token: str, label: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token.encode(), label + b"|" + role + b"|" + first + second, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, token: str | None, timeout: float = AUTH_TIMEOUT_S, pace=None) -> str:
    """Run the server side of the handshake; returns the role the client proved.

    Raises :class:`AuthError` (after telling the client why) when the client does not prove
    ``token``. With ``token=None`` any client that speaks the protocol is accepted. The whole
    handshake must finish within ``timeout`` seconds. ``pace(ok)``, when given, is called once
    the answer is checked and before the verdict is sent (the server slows down guessing there).
    """
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    nonce_s = os.urandom(NONCE)
    try:
        sock.sendall(MAGIC + bytes([1 if token else 0]) + nonce_s)
        reply = recv_exact(sock, 1 + NONCE + MAC, deadline)
    except (OSError, EOFError) as e:
        if pace:
            pace(False)
        raise AuthError(f"handshake failed: {e}") from None
    role, nonce_c, mac = reply[:1], reply[1:1 + NONCE], reply[1 + NONCE:]
    reason = None
    if role not in ROLES:
        reason = "not a tapml client (unknown role)"
    elif token and not hmac.compare_digest(mac, _mac(token, b"client", role, nonce_s, nonce_c)):
        reason = "token does not match"
    if pace:
        pace(reason is None)
    if reason:
        msg = reason.encode()
        try:
            sock.sendall(b"NO" + struct.pack("!H", len(msg)) + msg)
        except OSError:
            pass
        raise AuthError(reason)
    proof = _mac(token, b"server", role, nonce_c, nonce_s) if token else bytes(MAC)
    try:
        sock.sendall(b"OK" + proof)
    except OSError as e:
        raise AuthError(f"handshake failed: {e}") from None
    sock.settimeout(None)
    return ROLES[role]


def client_handshake(sock: socket.socket, token: str | None, role: str, timeout: float = AUTH_TIMEOUT_S) -> None:
    """Run the client side of the handshake for ``role``.

    Raises :class:`AuthError` with a message that says what to fix when the server refuses,
    needs a token the client lacks, or cannot prove it holds the same token. The whole
    handshake must finish within ``timeout`` seconds.
    """
    code = ROLE_OF[role]
    old = sock.gettimeout()
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    try:
        hello = recv_exact(sock, len(MAGIC) + 1 + NONCE, deadline)
        if hello[:len(MAGIC)] != MAGIC:
            raise AuthError("the server does not speak the tapml protocol (is it a `tapml serve`?)")
        needs_token, nonce_s = hello[len(MAGIC)], hello[len(MAGIC) + 1:]
        if needs_token and not token:
            raise AuthError("the server requires a token; pass --token-file or set TAPML_TOKEN")
        nonce_c = os.urandom(NONCE)
        mac = _mac(token, b"client", code, nonce_s, nonce_c) if token else bytes(MAC)
        sock.sendall(code + nonce_c + mac)
        status = recv_exact(sock, 2, deadline)
        if status == b"NO":
            (n,) = struct.unpack("!H", recv_exact(sock, 2, deadline))
            reason = recv_exact(sock, n, deadline).decode(errors="replace")
            raise AuthError(f"the server refused the connection: {reason}"
                            + ("; check --token-file / TAPML_TOKEN" if "token" in reason else ""))
        if status != b"OK":
            raise AuthError("the server sent a malformed handshake reply")
        proof = recv_exact(sock, MAC, deadline)
        if needs_token and not hmac.compare_digest(proof, _mac(token, b"server", code, nonce_c, nonce_s)):
            raise AuthError("the server could not prove it holds the token; it is not the server you meant")
    except (OSError, EOFError) as e:
        raise AuthError(f"handshake failed: {e}") from None
    finally:
        try:
            sock.settimeout(old)
        except OSError:
            pass


# --- bulk messages -----------------------------------------------------------------------

def send_message(sock: socket.socket, kind: bytes, slot: int = 0, payload=b"", dtype: int = 0,
                 shape: tuple[int, ...] = ()) -> None:
    """Send one bulk message; ``payload`` is any bytes-like object (sent without copying)."""
    view = memoryview(payload).cast("B") if len(payload) else memoryview(b"")
    head = HEADER.pack(kind, slot, dtype, len(shape), len(view)) + struct.pack(f"!{len(shape)}Q", *shape)
    if len(view) <= 65536:
        sock.sendall(head + bytes(view))
    else:
        sock.sendall(head)
        sock.sendall(view)


def send_header(sock: socket.socket, kind: bytes, nbytes: int = 0, slot: int = 0) -> None:
    """Send a bare header (raw-endpoint commands carry a byte count but no payload)."""
    sock.sendall(HEADER.pack(kind, slot, 0, 0, nbytes))


def recv_header(sock: socket.socket, max_bytes: int) -> tuple[bytes, int, int, tuple[int, ...], int]:
    """Read one message header: ``(kind, slot, dtype code, shape, nbytes)``.

    Raises :class:`ProtocolError` for a header the protocol does not allow, including a
    payload over ``max_bytes`` (checked before a byte of it is read).
    """
    kind, slot, dtype, ndim, nbytes = HEADER.unpack(recv_exact(sock, HEADER.size))
    if ndim > MAX_NDIM:
        raise ProtocolError(f"tensor header has {ndim} dimensions (limit {MAX_NDIM})")
    shape = struct.unpack(f"!{ndim}Q", recv_exact(sock, 8 * ndim)) if ndim else ()
    if nbytes > max_bytes:
        raise ProtocolError(f"message of {nbytes} bytes exceeds the server's limit of {max_bytes} bytes "
                            "(tapml serve --max-message-mib)")
    return kind, slot, dtype, shape, nbytes


LAZY_PAYLOAD = 8 << 20


def recv_payload(sock: socket.socket, nbytes: int):
    """Receive a payload of ``nbytes`` into a writable buffer. Large payloads go into an anonymous
    mapping whose pages the kernel commits only as bytes arrive, so a header that announces
    a large tensor and then stalls holds no memory it has not been sent."""
    buf = _LazyBuffer(-1, nbytes) if nbytes >= LAZY_PAYLOAD else bytearray(nbytes)
    if nbytes:
        recv_into_exact(sock, memoryview(buf))
    return buf


class _LazyBuffer(mmap.mmap):
    def decode(self, *args, **kwargs) -> str:  # like bytearray, for error payloads
        return bytes(self).decode(*args, **kwargs)


def refuse(sock: socket.socket, reason: str, linger: float = 1.0) -> None:
    """Refuse a connection before its handshake: hello, then ``NO`` and ``reason``, then close
    once the client has read it (closing with its answer unread would reset the connection and
    lose the reason)."""
    msg = reason.encode()
    try:
        sock.settimeout(linger)
        sock.sendall(MAGIC + b"\x01" + bytes(NONCE) + b"NO" + struct.pack("!H", len(msg)) + msg)
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + linger
        while time.monotonic() < deadline and sock.recv(4096):
            pass
    except OSError:
        pass


def tensor_bytes(t):
    """``(dtype code, shape, bytes-like view)`` of a CPU tensor, without copying when contiguous.
    ValueError for a dtype the wire format has no code for."""
    import torch

    from tapml.graph import dtype_name
    name = dtype_name(t.dtype)
    if name not in DTYPE_CODE:
        raise ValueError(f"tensors of dtype {name} cannot be sent to a device server")
    t = t.detach().cpu().contiguous()
    shape = tuple(int(s) for s in t.shape)
    if t.numel() == 0:
        return DTYPE_CODE[name], shape, b""
    return DTYPE_CODE[name], shape, t.reshape(-1).view(torch.uint8).numpy().data


def tensor_from(dtype: int, shape: tuple[int, ...], payload: bytearray):
    """Rebuild a tensor from a received payload (no copy); ProtocolError when sizes disagree."""
    import torch

    from tapml.graph import torch_dtype
    if dtype >= len(DTYPES):
        raise ProtocolError(f"unknown dtype code {dtype}")
    tdtype = torch_dtype(DTYPES[dtype])
    expected = math.prod(shape) * tdtype.itemsize
    if expected != len(payload):
        raise ProtocolError(f"tensor {DTYPES[dtype]}{list(shape)} needs {expected} bytes, message has {len(payload)}")
    if not payload:
        return torch.empty(shape, dtype=tdtype)
    return torch.frombuffer(payload, dtype=torch.uint8).view(tdtype).reshape(shape)


def send_tensor(sock: socket.socket, kind: bytes, slot: int, tensor) -> None:
    """Send ``tensor`` as one bulk message of ``kind`` for ``slot``."""
    dtype, shape, payload = tensor_bytes(tensor)
    send_message(sock, kind, slot, payload, dtype, shape)


def send_error(sock: socket.socket, message: str, slot: int = 0) -> None:
    """Tell the peer why its message was refused; a peer that is already gone is ignored."""
    try:
        send_message(sock, ERR, slot, message.encode())
    except OSError:
        pass


# --- rpyc control channel with a size limit ----------------------------------------------

def limited_channel(stream, max_bytes: int, on_refuse=None):
    """An rpyc Channel over ``stream`` that refuses frames over ``max_bytes`` before reading them
    (calling ``on_refuse(message)``, then closing), and never compresses (zlib on large frames is
    what makes rpyc's defaults slow)."""
    from rpyc.core.channel import Channel

    class LimitedChannel(Channel):
        __slots__ = ()

        def recv(self):
            length, compressed = self.FRAME_HEADER.unpack(self.stream.read(self.FRAME_HEADER.size))
            reason = None
            if length > max_bytes:
                reason = f"control message of {length} bytes exceeds the limit of {max_bytes}"
            elif compressed:  # could expand past the limit; tapml never sends them
                reason = "compressed control messages are not accepted"
            if reason:
                if on_refuse:
                    on_refuse(reason)
                self.stream.close()
                raise MessageTooLarge(reason)
            return self.stream.read(length + len(self.FLUSHER))[:-len(self.FLUSHER)]

    return LimitedChannel(stream, compress=False)


class MessageTooLarge(EOFError):
    """A control frame over the size limit: the connection is closed (EOFError ends rpyc's loop)."""
