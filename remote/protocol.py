"""Wire protocol of the device server: authentication, authenticated size-limited framing, tensor transport.

Every TCP connection to ``tapml serve`` starts with a challenge-response handshake; what runs
after it depends on the *role* the client proved the token for:

``control``  an rpyc connection (JSON strings and small plain values; no pickle);
``bulk``     tensors as raw bytes with a small binary header, bound to one control session;
``raw``      the transport benchmark's baseline: bytes framed and tagged as bulk messages, no tensors.

Handshake (the token never travels; both sides prove they hold it, whatever the server says)::

    server -> client   MAGIC | flags (1: token required) | server nonce ns (32) | server id (16)
    client -> server   role (1) | client nonce nc (32) | HMAC(token, "client" | T)
    server -> client   "OK" | HMAC(token, "server" | T)
                   or  "NO" | u16 length | reason (utf-8), then close

    T = MAGIC | flags | ns | server id | role | nc       (the whole transcript)

A client that holds a token checks the server's proof always, not only when the server says it
needs one. Both sides then derive one key per direction from the token and the transcript
(``HMAC(HMAC(token, "keys" | T), "c2s" / "s2c")``), and every frame after the handshake, on the
control and the bulk connection, carries ``HMAC(key, counter | frame)`` with a per-direction
counter: a frame that is altered, injected, replayed, reordered or moved to another connection
fails its check and ends the connection. The server id is random per server process; a client
holds its control and bulk connections to the same one.

Bulk messages (both directions)::

    kind (4) | slot (u64) | dtype code (u8) | ndim (u8) | nbytes (u64) | shape (ndim x u64) | payload | tag (32)
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

MAGIC = b"TAPML/2\n"
PROTOCOL_VERSION = 2  # what `hello` reports; bump with MAGIC when the wire changes
MAGICS_BEFORE = (b"TAPML/1\n",)  # older protocols, named in the refusal
NONCE = 32
MAC = 32
SERVER_ID = 16
HELLO = len(MAGIC) + 1 + NONCE + SERVER_ID
ROLES = {b"C": "control", b"B": "bulk", b"R": "raw"}
ROLE_OF = {v: k for k, v in ROLES.items()}
AUTH_TIMEOUT_S = 10.0

# Wire codes are fixed forever: append, never reorder.
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
          "complex64", "uint64", "complex32")
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


TAG_FAILED = ("a frame failed its authentication check (altered, injected or replayed on the way, or the peer "
              "does not hold the session key); the connection is closed")


class FrameMac:
    """Tags of one direction of a connection: ``HMAC(key, counter | frame)``, the counter going up
    by one per frame, so a frame cannot be altered, replayed, dropped silently or reordered."""

    __slots__ = ("_key", "_count")

    def __init__(self, key: bytes):
        self._key, self._count = key, 0

    def begin(self, *parts):
        """An HMAC object for the next frame, fed ``parts`` so far; the caller feeds the rest
        (a payload streamed in chunks) and takes its ``digest()``."""
        h = hmac.new(self._key, struct.pack("!Q", self._count), hashlib.sha256)
        for part in parts:
            h.update(part)
        self._count += 1
        return h

    def tag(self, *parts) -> bytes:
        """The tag of the next frame, made of ``parts`` (bytes-like, hashed without copying)."""
        return self.begin(*parts).digest()

    def check(self, tag: bytes, *parts) -> None:
        """ProtocolError unless ``tag`` is the next frame's tag over ``parts``."""
        if not hmac.compare_digest(tag, self.tag(*parts)):
            raise ProtocolError(TAG_FAILED)


class Handshake:
    """What a finished handshake established: the ``role`` the client proved, the ``server_id``
    the server stated in its hello (covered by both proofs), and the two directions' frame tags
    (``send``, ``recv``: :class:`FrameMac`) under keys only holders of the token can derive."""

    def __init__(self, role: str, server_id: bytes, send: FrameMac, recv: FrameMac):
        self.role, self.server_id, self.send, self.recv = role, server_id, send, recv


def _key(token: str | None) -> bytes:
    return (token or "").encode()


def _proof(token: str | None, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(_key(token), label + b"|" + transcript, hashlib.sha256).digest()


def _session(token: str | None, role: str, transcript: bytes, server_id: bytes, client: bool) -> Handshake:
    master = hmac.new(_key(token), b"keys|" + transcript, hashlib.sha256).digest()
    c2s = FrameMac(hmac.new(master, b"c2s", hashlib.sha256).digest())
    s2c = FrameMac(hmac.new(master, b"s2c", hashlib.sha256).digest())
    return Handshake(role, server_id, *((c2s, s2c) if client else (s2c, c2s)))


def server_handshake(sock: socket.socket, token: str | None, timeout: float = AUTH_TIMEOUT_S, pace=None,
                     server_id: bytes | None = None) -> Handshake:
    """Run the server side of the handshake; returns the :class:`Handshake` (role the client
    proved, frame keys).

    Raises :class:`AuthError` (after telling the client why) when the client does not prove
    ``token``. With ``token=None`` any client that speaks the protocol is accepted. The whole
    handshake must finish within ``timeout`` seconds. ``pace(ok)``, when given, is called once
    the answer is checked and before the verdict is sent (the server slows down guessing there).
    ``server_id`` (16 bytes, random per server process) is stated in the hello and bound into
    both proofs and the session keys.
    """
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    nonce_s = os.urandom(NONCE)
    server_id = server_id if server_id is not None else os.urandom(SERVER_ID)
    hello = MAGIC + bytes([1 if token else 0]) + nonce_s + server_id
    try:
        sock.sendall(hello)
        reply = recv_exact(sock, 1 + NONCE + MAC, deadline)
    except (OSError, EOFError) as e:
        if pace:
            pace(False)
        raise AuthError(f"handshake failed: {e}") from None
    role, nonce_c, mac = reply[:1], reply[1:1 + NONCE], reply[1 + NONCE:]
    transcript = hello + role + nonce_c
    reason = None
    if role not in ROLES:
        reason = "not a tapml client (unknown role)"
    elif token and not hmac.compare_digest(mac, _proof(token, b"client", transcript)):
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
    proof = _proof(token, b"server", transcript) if token else bytes(MAC)
    try:
        sock.sendall(b"OK" + proof)
    except OSError as e:
        raise AuthError(f"handshake failed: {e}") from None
    sock.settimeout(None)
    return _session(token, ROLES[role], transcript, server_id, client=False)


def client_handshake(sock: socket.socket, token: str | None, role: str, timeout: float = AUTH_TIMEOUT_S) -> Handshake:
    """Run the client side of the handshake for ``role``; returns the :class:`Handshake`.

    A client that holds ``token`` accepts only a server that proves it holds the same token,
    whatever the server says it needs. Raises :class:`AuthError` with a message that says what
    to fix when the server refuses, needs a token the client lacks, or cannot prove it holds
    the client's token. The whole handshake must finish within ``timeout`` seconds.
    """
    code = ROLE_OF[role]
    old = sock.gettimeout()
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    try:
        hello = recv_exact(sock, len(MAGIC), deadline)
        if hello in MAGICS_BEFORE:
            raise AuthError("the server speaks an older tapml protocol; use the same tapml version on both sides")
        if hello != MAGIC:
            raise AuthError("the server does not speak the tapml protocol (is it a `tapml serve`?)")
        hello += recv_exact(sock, HELLO - len(MAGIC), deadline)
        needs_token = hello[len(MAGIC)]
        server_id = hello[len(MAGIC) + 1 + NONCE:]
        if needs_token and not token:
            raise AuthError("the server requires a token; pass --token-file or set TAPML_TOKEN")
        nonce_c = os.urandom(NONCE)
        transcript = hello + code + nonce_c
        mac = _proof(token, b"client", transcript) if token else bytes(MAC)
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
        if token and not hmac.compare_digest(proof, _proof(token, b"server", transcript)):
            said = "" if needs_token else " (it says it needs no token)"
            raise AuthError(f"the server could not prove it holds your token{said}; it is not the server you meant, "
                            "or it was started with another token or none")
    except (OSError, EOFError) as e:
        raise AuthError(f"handshake failed: {e}") from None
    finally:
        try:
            sock.settimeout(old)
        except OSError:
            pass
    return _session(token, role, transcript, server_id, client=True)


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


class Link:
    """A bulk connection after its handshake: messages as :func:`send_message` writes them, each
    followed by its :class:`FrameMac` tag, checked before a received message is acted on.

    :meth:`recv_header` and then :meth:`recv_payload` (always, even for an empty payload: it
    checks the tag) read one message. ``max_bytes`` is checked from the header, before a byte of
    the payload is read. Sending is serialized by a lock; receiving is for one thread."""

    def __init__(self, sock: socket.socket, auth: Handshake):
        import threading
        self.sock, self.auth = sock, auth
        self._send_lock = threading.Lock()
        self.head = b""  # the last header read: the start of what its tag covers

    def send(self, kind: bytes, slot: int = 0, payload=b"", dtype: int = 0, shape: tuple[int, ...] = ()) -> None:
        """Send one message; ``payload`` is any bytes-like object (sent without copying)."""
        view = memoryview(payload).cast("B") if len(payload) else memoryview(b"")
        head = HEADER.pack(kind, slot, dtype, len(shape), len(view)) + struct.pack(f"!{len(shape)}Q", *shape)
        with self._send_lock:
            tag = self.auth.send.tag(head, view)
            if len(view) <= 65536:
                self.sock.sendall(head + bytes(view) + tag)
            else:
                self.sock.sendall(head)
                self.sock.sendall(view)
                self.sock.sendall(tag)

    def send_tensor(self, kind: bytes, slot: int, tensor) -> None:
        """Send ``tensor`` as one message of ``kind`` for ``slot``."""
        dtype, shape, payload = tensor_bytes(tensor)
        self.send(kind, slot, payload, dtype, shape)

    def send_error(self, message: str, slot: int = 0) -> None:
        """Tell the peer why its message was refused; a peer that is already gone is ignored."""
        try:
            self.send(ERR, slot, message.encode())
        except OSError:
            pass

    def recv_header(self, max_bytes: int) -> tuple[bytes, int, int, tuple[int, ...], int]:
        """:func:`recv_header` of the next message (its tag is checked by :meth:`recv_payload`)."""
        head = recv_exact(self.sock, HEADER.size)
        kind, slot, dtype, ndim, nbytes = HEADER.unpack(head)
        if ndim > MAX_NDIM:
            raise ProtocolError(f"tensor header has {ndim} dimensions (limit {MAX_NDIM})")
        dims = recv_exact(self.sock, 8 * ndim) if ndim else b""
        if nbytes > max_bytes:
            raise ProtocolError(f"message of {nbytes} bytes exceeds the server's limit of {max_bytes} bytes "
                                "(tapml serve --max-message-mib)")
        self.head = head + dims
        return kind, slot, dtype, struct.unpack(f"!{ndim}Q", dims) if ndim else (), nbytes

    def recv_payload(self, nbytes: int):
        """The payload of the message whose header was just read, once its tag checks out
        (ProtocolError otherwise); large payloads as :func:`recv_payload` receives them."""
        buf = recv_payload(self.sock, nbytes)
        tag = recv_exact(self.sock, MAC)
        self.auth.recv.check(tag, self.head, memoryview(buf))
        return buf

    def recv_through(self, nbytes: int, chunk: memoryview) -> None:
        """Receive the payload of the message whose header was just read through ``chunk``,
        keeping none of it, and check its tag (ProtocolError otherwise)."""
        h = self.auth.recv.begin(self.head)
        while nbytes:
            k = min(nbytes, len(chunk))
            recv_into_exact(self.sock, chunk[:k])
            h.update(chunk[:k])
            nbytes -= k
        if not hmac.compare_digest(recv_exact(self.sock, MAC), h.digest()):
            raise ProtocolError(TAG_FAILED)

    def send_repeated(self, kind: bytes, nbytes: int, chunk: memoryview) -> None:
        """Send a message of ``nbytes`` made of ``chunk`` over and over (benchmark payloads of
        any size from one buffer)."""
        head = HEADER.pack(kind, 0, 0, 0, nbytes)
        with self._send_lock:
            h = self.auth.send.begin(head)
            self.sock.sendall(head)
            while nbytes:
                k = min(nbytes, len(chunk))
                h.update(chunk[:k])
                self.sock.sendall(chunk[:k])
                nbytes -= k
            self.sock.sendall(h.digest())

    def recv(self, max_bytes: int):
        """One whole message: ``(kind, slot, dtype, shape, payload)``."""
        kind, slot, dtype, shape, nbytes = self.recv_header(max_bytes)
        return kind, slot, dtype, shape, self.recv_payload(nbytes)

    def close(self) -> None:
        self.sock.close()


def refuse(sock: socket.socket, reason: str, linger: float = 1.0) -> None:
    """Refuse a connection before its handshake: hello, then ``NO`` and ``reason``, then close
    once the client has read it (closing with its answer unread would reset the connection and
    lose the reason)."""
    msg = reason.encode()
    try:
        sock.settimeout(linger)
        sock.sendall(MAGIC + b"\x01" + bytes(NONCE + SERVER_ID) + b"NO" + struct.pack("!H", len(msg)) + msg)
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
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()  # a conj view travels as its values
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

def limited_channel(stream, max_bytes: int, auth: Handshake, on_refuse=None):
    """An rpyc Channel over ``stream`` whose frames carry ``auth``'s tags (checked before a frame
    is handed to rpyc), that refuses frames over ``max_bytes`` before reading them (calling
    ``on_refuse(message)``, then closing), and never compresses (zlib on large frames is what
    makes rpyc's defaults slow).

    Frame: rpyc's header (u32 length, u8 compressed = 0) | data | tag (32) | rpyc's flusher."""
    from rpyc.core.channel import Channel

    class AuthenticatedChannel(Channel):
        __slots__ = ()

        def recv(self):
            head = self.stream.read(self.FRAME_HEADER.size)
            length, compressed = self.FRAME_HEADER.unpack(head)
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
            body = self.stream.read(length + MAC + len(self.FLUSHER))
            data, tag = body[:length], body[length:length + MAC]
            try:
                auth.recv.check(tag, head, data)
            except ProtocolError as e:
                if on_refuse:
                    on_refuse(str(e))
                self.stream.close()
                raise FrameRejected(str(e)) from None
            return data

        def send(self, data):
            head = self.FRAME_HEADER.pack(len(data), 0)
            tag = auth.send.tag(head, data)
            if len(data) <= 65536:
                self.stream.write(head + data + tag + self.FLUSHER)
            else:
                self.stream.write(head)
                self.stream.write(data)
                self.stream.write(tag + self.FLUSHER)

    return AuthenticatedChannel(stream, compress=False)


class FrameRejected(EOFError):
    """A control frame that failed its tag check: the connection is closed (EOFError ends rpyc's loop)."""


class MessageTooLarge(EOFError):
    """A control frame over the size limit: the connection is closed (EOFError ends rpyc's loop)."""


def two_word_refs(value) -> tuple[str, ...]:
    """The refs a peer's run reply says it held in two 32-bit words (``int64_two_words``): a list
    of short strings, else none (a reply's field is never trusted)."""
    if not isinstance(value, list) or len(value) > 10_000 or not all(isinstance(r, str) and len(r) <= 200 for r in value):
        return ()
    return tuple(value)
