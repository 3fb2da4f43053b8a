"""Fuzzing the network boundaries: a real ``tapml serve`` subprocess gets random and malformed
bytes before authentication, and random rpyc frames, bulk frames and raw-endpoint headers after
it; the browser bridge gets random HTTP paths and random WebSocket frames from its page.

Every input ends in a refusal (``NO`` and a reason, an ``ERR`` message, an rpyc error reply or a
closed connection) within seconds; the server stays up, keeps answering real clients correctly
and its memory stays bounded. The number of inputs tried is printed in the run's summary.
"""

import itertools
import json
import socket
import struct
import time

import pytest
from support import rss_mib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tapml.remote import protocol as P

TOKEN = "fuzz-token-0123456789"
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
REPLY_TIMEOUT_S = 3.0
MAX_RSS_GROWTH_MIB = 150


@pytest.fixture(scope="module")
def server():
    from tapml.remote.launcher import ServerProcess
    srv = ServerProcess(platform="reference", token=TOKEN, args=("--max-message-mib", "4"))
    yield srv
    code = srv.stop()
    assert code == 0, "".join(srv.stderr_lines[-30:])


def still_serves(srv, mlp) -> None:
    """The server is up and a real client gets the right answers."""
    from tapml.remote.client import RemotePlatform
    from tapml.driving.replay import replay
    assert srv.proc.poll() is None, "the server died"
    with RemotePlatform(srv.host, srv.port, token=TOKEN, timeout=30) as platform:
        assert replay(mlp, platform, srv.target, cases=mlp.cases[:3])["summary"]["pass"] == 3


# Each pre-authentication input comes from its own loopback address: the server slows down
# failed handshakes per address, which is what a brute-force test checks (test_hostile.py).
_sources = (f"127.{a}.{b}.{c}" for a, b, c in itertools.product(range(10, 250), range(256), range(1, 255)))


def connect(srv, source: str | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(10)
    if source:
        sock.bind((source, 0))
    sock.connect((srv.host, srv.port))
    return sock


def read_until_closed(sock: socket.socket, timeout: float = REPLY_TIMEOUT_S, limit: int = 1 << 20,
                      must_close: bool = False) -> bytes:
    """Everything the server sends until it closes (or ``timeout``, a failure with ``must_close``)."""
    deadline = time.monotonic() + timeout
    data = b""
    while len(data) < limit:
        left = deadline - time.monotonic()
        if left <= 0:
            assert not must_close, f"the server neither answered nor closed within {timeout}s"
            break
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, socket.timeout):
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def authenticated(srv, role: str) -> tuple[socket.socket, "P.Handshake"]:
    """A socket past the handshake and its session keys (a fuzzer that holds the token signs its
    frames, so they reach the parsers behind the frame check)."""
    sock = connect(srv)
    auth = P.client_handshake(sock, TOKEN, role)
    sock.settimeout(REPLY_TIMEOUT_S)
    return sock, auth


# --- before authentication ------------------------------------------------------------------

handshake_replies = st.one_of(
    st.binary(max_size=200),                                                  # anything at all
    st.builds(lambda role, rest: role + rest, st.sampled_from(list(P.ROLES)), st.binary(min_size=64, max_size=64)),
    st.builds(lambda role, rest: role + rest, st.binary(min_size=1, max_size=1), st.binary(min_size=64, max_size=64)),
    st.just(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64)),
)


def test_random_bytes_before_authentication_are_refused(server, mlp, figure):
    rss_before = rss_mib(server.proc.pid)
    outcomes = {"refused": 0, "closed": 0}

    @FUZZ
    @given(handshake_replies, st.booleans())
    def check(reply, read_hello_first):
        with connect(server, next(_sources)) as sock:
            if read_hello_first:
                hello = P.recv_exact(sock, P.HELLO)
                assert hello.startswith(P.MAGIC) and hello[len(P.MAGIC)] == 1
            sock.sendall(reply)
            try:
                sock.shutdown(socket.SHUT_WR)  # a short answer must not leave the server waiting
            except OSError:
                pass
            data = read_until_closed(sock)
        answer = data[P.HELLO:] if not read_hello_first else data
        assert not answer.startswith(b"OK"), "the server accepted a random answer"
        if answer.startswith(b"NO"):
            (n,) = struct.unpack("!H", answer[2:4])
            assert answer[4:4 + n].decode()  # a reason
            outcomes["refused"] += 1
        else:
            assert answer == b""
            outcomes["closed"] += 1

    check()
    still_serves(server, mlp)
    tried = sum(outcomes.values())
    figure("fuzzed handshakes tried (before authentication)", tried)
    assert tried >= 100 and outcomes["refused"] > 0
    assert rss_mib(server.proc.pid) - rss_before < MAX_RSS_GROWTH_MIB


# --- after authentication: the rpyc control channel -----------------------------------------

def rpyc_frame(payload: bytes, length: int | None = None, compressed: int = 0) -> tuple[bytes, bytes]:
    """(header, payload) of an rpyc frame, signed when sent (:func:`signed`)."""
    return struct.pack("!LB", len(payload) if length is None else length, compressed), payload


def signed(auth, frame: tuple[bytes, bytes]) -> bytes:
    """An rpyc frame with the tag of the next frame of this session (protocol.limited_channel)."""
    head, payload = frame
    return head + payload + auth.send.tag(head, payload) + b"\n"


def brine_values():
    """Values rpyc's brine encodes: None, bools, ints, floats, str, bytes, tuples."""
    leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12)
            | st.binary(max_size=16) | st.sampled_from(["exposed_compile", "exposed_run", "exposed_load", "exposed_free",
                                                         "exposed_supports", "exposed_bench_tensor", "exposed_hello",
                                                         "_conn", "__class__", "on_connect", "session", "__dict__"]))
    return st.recursive(leaf, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=10)


def boxed():
    """rpyc's boxed arguments: (label, value) with every label, remote references included."""
    return st.tuples(st.integers(0, 5), brine_values()) | st.lists(st.tuples(st.integers(0, 5), brine_values()),
                                                                   max_size=4).map(tuple)


control_messages = st.one_of(
    st.binary(max_size=300).map(rpyc_frame),                                     # random payloads
    st.builds(lambda n, body: rpyc_frame(body, n), st.integers(0, 2**32 - 1), st.binary(max_size=64)),  # lying lengths
    st.builds(lambda body: rpyc_frame(body, compressed=1), st.binary(max_size=64)),
    st.builds(lambda msg, seq, handler, args: (msg, seq, handler, args),            # well-formed brine requests
              st.integers(0, 5), st.integers(-5, 2**40), st.integers(0, 25), boxed()),
)


def test_random_control_frames_after_authentication(server, mlp, figure):
    from rpyc.core import brine
    rss_before = rss_mib(server.proc.pid)
    tried = 0

    @FUZZ
    @given(control_messages)
    def check(message):
        nonlocal tried
        if len(message) == 4:  # a brine request to encode (frames are (header, payload) pairs)
            msg, seq, handler, args = message
            try:
                message = rpyc_frame(brine.I1.pack(msg) + brine.dump((seq, (handler, args))))
            except (ValueError, TypeError, struct.error):
                return
        tried += 1
        sock, auth = authenticated(server, "control")
        with sock:
            try:
                sock.sendall(signed(auth, message))
                sock.shutdown(socket.SHUT_WR)  # the server answers what it got, then sees the end
            except OSError:
                pass  # closed by the server part-way: a refusal
            read_until_closed(sock, timeout=10, must_close=True)
        if tried % 40 == 0:
            still_serves(server, mlp)

    check()
    still_serves(server, mlp)
    figure("fuzzed control frames tried (after authentication)", tried)
    assert tried >= 100
    assert rss_mib(server.proc.pid) - rss_before < MAX_RSS_GROWTH_MIB


# --- after authentication: bulk tensors and the raw endpoint --------------------------------

kinds = st.sampled_from([P.PUT, P.PUTA, P.GET, P.GETK, P.SESS, P.ACK, P.ERR, P.TENSOR]) | st.binary(min_size=4, max_size=4)
bulk_headers = st.tuples(
    kinds, st.integers(0, 2**64 - 1), st.integers(0, 255),
    st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 64), max_size=70),
    st.integers(0, 2**64 - 1) | st.integers(0, 4096) | st.just(16 << 20),
    st.binary(max_size=4096))


def test_random_bulk_messages_after_authentication(server, mlp, figure):
    from tapml.remote.client import RemotePlatform
    rss_before = rss_mib(server.proc.pid)
    outcomes = {"error reply": 0, "answered": 0, "closed": 0}
    control = RemotePlatform(server.host, server.port, token=TOKEN)
    session = bytes.fromhex(control.info["session"])

    @FUZZ
    @given(st.lists(bulk_headers, min_size=1, max_size=3), st.booleans())
    def check(messages, bind):
        sock, auth = authenticated(server, "bulk")
        with sock:
            link = P.Link(sock, auth)
            if bind:  # bound to a live session, as a real client's bulk socket is
                link.send(P.SESS, 0, session)
                assert link.recv(4096)[0] == P.ACK
            try:
                for kind, slot, dtype, shape, nbytes, body in messages:
                    head = P.HEADER.pack(kind, slot, dtype, len(shape) % 256, nbytes) + struct.pack(f"!{len(shape)}Q", *shape)
                    # signed as a holder of the token would: the message reaches the server's parser
                    sock.sendall(head + body[:nbytes] + (auth.send.tag(head, body[:nbytes]) if len(body) >= nbytes else b""))
            except OSError:
                pass
            data = read_until_closed(sock, timeout=0.5)
        if data[:4] == P.ERR:
            outcomes["error reply"] += 1
        elif data:
            outcomes["answered"] += 1
        else:
            outcomes["closed"] += 1

    check()
    control.close()
    still_serves(server, mlp)
    tried = sum(outcomes.values())
    figure("fuzzed bulk messages tried (after authentication)", tried)
    assert tried >= 100 and outcomes["error reply"] > 0
    assert rss_mib(server.proc.pid) - rss_before < MAX_RSS_GROWTH_MIB


def test_random_raw_headers_after_authentication(server, mlp, figure):
    tried = 0

    @settings(FUZZ, max_examples=60)
    @given(st.sampled_from([P.SINK, P.SOURCE, P.PING]) | st.binary(min_size=4, max_size=4),
           st.integers(0, 2**64 - 1) | st.integers(0, 1 << 16))
    def check(kind, nbytes):
        nonlocal tried
        tried += 1
        sock, auth = authenticated(server, "raw")
        with sock:
            head = P.HEADER.pack(kind, nbytes if kind == P.SOURCE else 0, 0, 0, 0 if kind == P.SOURCE else nbytes)
            try:
                sock.sendall(head + auth.send.tag(head))  # signed, as a holder of the token would
                sock.shutdown(socket.SHUT_WR)  # a SINK waiting for bytes that never come ends at EOF
            except OSError:
                pass  # an unknown kind: the server closed at once
            read_until_closed(sock, timeout=1.0, limit=1 << 17)

    check()
    still_serves(server, mlp)
    figure("fuzzed raw-endpoint headers tried (after authentication)", tried)


# --- the browser bridge -------------------------------------------------------------------

def test_fuzzed_browser_frames_decode_or_fail_clearly(figure):
    from tapml.platforms.page_bridge import FRAME, FRAME_MAGIC, decode_frame, encode_frame
    tried = 0

    @settings(FUZZ, max_examples=300)
    @given(st.binary(max_size=64) | st.builds(lambda h, p: struct.pack("<IIII", FRAME_MAGIC, *h) + p,
                                              st.tuples(*[st.integers(0, 2**32 - 1)] * 3), st.binary(max_size=32)))
    def check(data):
        nonlocal tried
        tried += 1
        try:
            run_id, slot, kind, payload = decode_frame(data)
        except ValueError as e:
            assert "frame" in str(e)
            return
        assert encode_frame(run_id, slot, kind, payload) == data and len(data) >= FRAME.size

    check()
    figure("fuzzed browser frames decoded", tried)


page_messages = st.one_of(
    st.text(max_size=80),                                                           # not JSON
    st.builds(json.dumps, st.recursive(st.none() | st.integers() | st.text(max_size=8),
                                       lambda i: st.lists(i, max_size=3) | st.dictionaries(st.text(max_size=6), i, max_size=3),
                                       max_leaves=8)),
    st.builds(lambda t, extra: json.dumps({"type": t, **extra}),
              st.sampled_from(["hello", "done", "error", "lost", "run", "x"]),
              st.dictionaries(st.sampled_from(["id", "message", "code", "adapter", "error"]),
                              st.none() | st.integers() | st.text(max_size=8), max_size=3)),
    st.binary(max_size=64),
)


def test_browser_bridge_survives_random_page_frames(figure):
    """Random HTTP paths get 403/404 without touching the page; random WebSocket frames from the
    page end in "device lost" with a reason (the page is the device) or are ignored — never a
    crash, a hang or a bridge that stops answering."""
    import urllib.error
    import urllib.request

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect as ws_connect

    from tapml.errors import DeviceLost
    from tapml.platforms.page_bridge import PageBridge
    outcomes = {"http refused": 0, "page lost": 0, "ignored": 0}

    @settings(FUZZ, max_examples=40)
    @given(st.lists(page_messages, min_size=1, max_size=4), st.text(max_size=30))
    def check(messages, path):
        bridge = PageBridge()
        try:
            base = bridge.url.split("/t/")[0]
            try:
                urllib.request.urlopen(f"{base}/{urllib.request.quote(path)}", timeout=5).read()
            except urllib.error.HTTPError as e:
                assert e.code in (403, 404)
                outcomes["http refused"] += 1
            with ws_connect(bridge.url.replace("http://", "ws://") + "ws", origin=base, open_timeout=10) as ws:
                try:
                    for m in messages:
                        ws.send(m)
                    time.sleep(0.05)
                except ConnectionClosed:  # the bridge hung up on a bad frame: the page is lost
                    pass
            deadline = time.monotonic() + 5
            while bridge.lost is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert bridge.lost, "the page's closed connection was not noticed"
            start = time.monotonic()
            with pytest.raises(DeviceLost):
                bridge.request({"type": "run", "id": 1, "key": "k"}, [], timeout=5)
            assert time.monotonic() - start < 2
            outcomes["page lost" if "failed" in bridge.lost else "ignored"] += 1
        finally:
            bridge.close()

    check()
    figure("fuzzed browser-bridge page sessions tried", outcomes["page lost"] + outcomes["ignored"])
    assert outcomes["http refused"] > 0 and outcomes["page lost"] > 0
