"""Hostile and unlucky peers against a real ``tapml serve`` subprocess on loopback: slow-loris
handshakes, a flood of idle connections, an authenticated client announcing 10 GiB, many
concurrent clients, a wrong-token brute force, and token comparison in constant time.

Connections that stand for other machines bind their own loopback source address
(127.x.y.z): the server bounds and slows unauthenticated work per address.
"""

import hmac
import socket
import struct
import threading
import time

import pytest
from support import rss_mib

from tapml.errors import TapmlError
from tapml.remote import protocol as P

TOKEN = "hostile-token-0123456789abcdef"


@pytest.fixture(scope="module")
def server():
    from tapml.remote.launcher import ServerProcess
    srv = ServerProcess(platform="reference", token=TOKEN)  # default 1 GiB message limit
    yield srv
    code = srv.stop()
    assert code == 0, "".join(srv.stderr_lines[-30:])


def replay_ok(srv, mlp, cases: int = 3) -> bool:
    from tapml.remote.client import RemotePlatform
    from tapml.driving.replay import replay
    with RemotePlatform(srv.host, srv.port, token=TOKEN, timeout=60) as platform:
        return replay(mlp, platform, srv.target, cases=mlp.cases[:cases])["summary"]["pass"] == cases


def connect(srv, source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(30)
    sock.connect((srv.host, srv.port))
    return sock


def closed_within(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except (TimeoutError, socket.timeout):
        return False
    except OSError:
        pass
    return True


def test_slow_loris_handshakes_are_cut_off_and_others_are_served(server, mlp, figure):
    """Clients that trickle their handshake answer one byte at a time are dropped when the
    whole handshake's 10 s are up (not 10 s per byte), and real clients are served meanwhile."""
    socks = [connect(server, f"127.201.0.{i}") for i in range(1, 13)]
    stop = threading.Event()

    def trickle():
        for i in range(65):
            for s in socks:
                try:
                    s.send(b"C" if i == 0 else b"\0")
                except OSError:
                    pass
            if stop.wait(0.5):
                return

    start = time.monotonic()
    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        assert replay_ok(server, mlp)  # served while the slow clients hang on
        closed = sum(closed_within(s, max(0.1, start + 14 - time.monotonic())) for s in socks)
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        for s in socks:
            s.close()
    assert closed == len(socks), f"only {closed} of {len(socks)} slow clients were dropped"
    assert elapsed < 14
    assert server.proc.poll() is None and replay_ok(server, mlp)
    figure("slow-loris connections dropped", closed)


def test_connection_flood_from_one_address_is_refused_clearly(server, mlp):
    idle = [connect(server, "127.202.0.1") for _ in range(40)]  # never answer the handshake
    try:
        time.sleep(0.5)
        late = connect(server, "127.202.0.1")
        with pytest.raises(P.AuthError, match="too many connections from your address"):
            P.client_handshake(late, TOKEN, "control", timeout=10)
        late.close()
        assert replay_ok(server, mlp)  # other addresses are served as usual
    finally:
        for s in idle:
            s.close()
    assert server.proc.poll() is None


def test_ten_gib_size_header_after_authentication(server, mlp, figure):
    from tapml.remote.client import RemotePlatform
    rss = rss_mib(server.proc.pid)
    with RemotePlatform(server.host, server.port, token=TOKEN) as platform:
        session = bytes.fromhex(platform.info["session"])

        def bulk():
            sock = socket.create_connection((server.host, server.port), timeout=30)
            link = P.Link(sock, P.client_handshake(sock, TOKEN, "bulk"))
            link.send(P.SESS, 0, session)
            assert link.recv(4096)[0] == P.ACK
            return link

        # 10 GiB announced on the bulk socket: refused from its header, before a byte is read.
        link = bulk()
        link.sock.sendall(P.HEADER.pack(P.PUT, 1, 0, 1, 10 << 30) + struct.pack("!Q", (10 << 30) // 4))
        kind, _, _, _, payload = link.recv(4096)
        assert kind == P.ERR and b"exceeds the server's limit" in payload
        assert closed_within(link.sock, 10)
        link.close()

        # 10 GiB announced in an rpyc frame on a control connection: the connection is dropped.
        control = socket.create_connection((server.host, server.port), timeout=30)
        P.client_handshake(control, TOKEN, "control")
        control.sendall(struct.pack("!LB", 0xFFFFFFFF, 0) + bytes(64))
        assert closed_within(control, 10)
        control.close()

        # 900 MiB announced (under the limit), 1 MiB sent, then silence: the server holds only
        # what it was sent, not what was announced.
        held = [bulk().sock for _ in range(3)]
        for sock in held:
            sock.sendall(P.HEADER.pack(P.PUT, 2, 0, 1, 900 << 20) + struct.pack("!Q", (900 << 20) // 4))
            sock.sendall(bytes(1 << 20))
        time.sleep(1.0)
        grown = rss_mib(server.proc.pid) - rss
        for sock in held:
            sock.close()
    assert grown < 100, f"the server's memory grew by {grown:.0f} MiB for 3 stalled 900 MiB uploads"
    assert server.proc.poll() is None and replay_ok(server, mlp)
    figure("server RSS growth for three stalled 900 MiB uploads (MiB)", round(grown, 1))


def test_many_concurrent_clients_get_correct_answers_or_a_clear_refusal(server, mlp, figure):
    from tapml.remote.client import RemotePlatform
    from tapml.driving.replay import replay
    clients = 24
    results: list[str] = []
    barrier = threading.Barrier(clients)

    def client():
        barrier.wait()
        try:
            with RemotePlatform(server.host, server.port, token=TOKEN, timeout=120) as platform:
                summary = replay(mlp, platform, server.target)["summary"]
            results.append("correct" if summary["pass"] == len(mlp.cases) else f"wrong {summary}")
        except TapmlError as e:
            assert "retry" in str(e) or "refused" in str(e), e
            results.append("refused")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == clients and not any(r.startswith("wrong") for r in results), results
    assert results.count("correct") >= clients // 2
    assert server.proc.poll() is None and replay_ok(server, mlp)
    figure("concurrent clients answered correctly", f"{results.count('correct')}/{clients} "
                                                   f"({results.count('refused')} refused)")


def test_wrong_token_brute_force_is_slowed_down(server, mlp, figure):
    guesses = 10
    source = "127.203.0.1"
    refusals = []

    def guess(i):
        sock = connect(server, source)
        try:
            P.client_handshake(sock, f"guess-{i}", "control", timeout=60)
        except P.AuthError as e:
            refusals.append(str(e))
        finally:
            sock.close()

    start = time.monotonic()
    threads = [threading.Thread(target=guess, args=(i,)) for i in range(guesses)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    elapsed = time.monotonic() - start
    assert len(refusals) == guesses and all("token does not match" in r for r in refusals), refusals
    # Parallel guesses from one address wait their turns: 0.05 + 0.1 + ... + 1 + 1 ... seconds.
    assert elapsed > 4, f"{guesses} wrong guesses answered in {elapsed:.1f}s"
    # The right token is not delayed, from anywhere.
    start = time.monotonic()
    sock = connect(server, source)
    P.client_handshake(sock, TOKEN, "control", timeout=10)
    sock.close()
    assert time.monotonic() - start < 1.0
    assert replay_ok(server, mlp)
    figure("wrong-token guesses per second from one address", round(guesses / elapsed, 2))


def test_token_comparisons_are_constant_time(monkeypatch):
    """Every secret comparison goes through hmac.compare_digest, on MACs of the same length."""
    from tapml.remote import protocol
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(protocol.hmac, "compare_digest", spy)
    for client_token in ("secret-token", "wrong-token", "secret-tokeN"):
        a, b = socket.socketpair()

        def client(sock=a, token=client_token):
            try:
                P.client_handshake(sock, token, "bulk")
            except P.AuthError:
                pass

        t = threading.Thread(target=client)
        t.start()
        try:
            assert P.server_handshake(b, "secret-token").role == "bulk"
        except P.AuthError as e:
            assert "token does not match" in str(e)
        t.join(10)
        a.close()
        b.close()
    assert calls and all(sizes == (P.MAC, P.MAC) for sizes in calls)
    assert len(calls) >= 4  # three server checks and the good client's check of the server's proof


def test_browser_page_token_is_compared_in_constant_time(monkeypatch):
    import urllib.error
    import urllib.request

    from tapml.platforms import page_bridge as browser
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(browser.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    bridge = browser.PageBridge()
    try:
        base = bridge.url.split("/t/")[0]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{base}/t/{'x' * len(bridge.token)}/", timeout=10)
        assert e.value.code == 403
        assert urllib.request.urlopen(bridge.url, timeout=10).status == 200
    finally:
        bridge.close()
    assert len(calls) == 2
