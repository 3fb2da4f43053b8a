"""ServerProcess: a ``tapml serve`` subprocess on loopback, for tests and the transport benchmark."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading


class ServerProcess:
    """A ``tapml serve`` subprocess on loopback (tests and the benchmark use it).

    Example::

        with ServerProcess(platform="reference", token="s3cret") as srv:
            RemotePlatform(srv.host, srv.port, token="s3cret")
    """

    def __init__(self, platform: str = "reference", token: str | None = None, port: int = 0,
                 host: str = "127.0.0.1", args: tuple[str, ...] = (), startup_s: float = 60.0):
        env = dict(os.environ)
        env.pop("TAPML_TOKEN", None)
        if token:
            env["TAPML_TOKEN"] = token
        cmd = [sys.executable, "-m", "tapml.cli", "serve", "--platform", platform, "--host", host,
               "--port", str(port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.stderr_lines: list[str] = []
        # Both pipes are drained for the server's whole life (a chatty server never blocks on a
        # full pipe); the address comes through a queue so that waiting for it has a deadline
        # even when the server prints nothing.
        address: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, args=(self.proc.stdout, self.lines, address), daemon=True).start()
        stderr = threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr_lines), daemon=True)
        stderr.start()
        try:
            found = address.get(timeout=startup_s)
        except queue.Empty:
            self.kill()
            raise RuntimeError(f"tapml serve did not start listening within {startup_s:g} s") from None
        if found is None:
            code = self.proc.wait()
            stderr.join(5)
            raise RuntimeError(f"tapml serve exited ({code}) before listening:\n{''.join(self.stderr_lines)}")
        self.host, self.port = found

    @staticmethod
    def _drain(pipe, sink: list, address: queue.Queue | None = None) -> None:
        for line in pipe:
            sink.append(line)
            m = address is not None and re.search(r"listening on (\S+):(\d+)", line)
            if m:
                address.put((m.group(1).strip("[]"), int(m.group(2))))
                address = None
        if address is not None:
            address.put(None)  # closed before it listened

    @property
    def target(self) -> str:
        return f"remote://{self.host}:{self.port}"

    def kill(self) -> None:
        """SIGKILL: the server dies without closing anything (a crashed device)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


__all__ = ["ServerProcess"]
