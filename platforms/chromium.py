"""The Chromium launcher of the ``browser`` target: a headless Chromium on a fresh profile.

The page URL (which holds a one-time token) never appears on Chromium's command line: the
browser opens a start file in its own 0700 profile directory that forwards it to the page
(see :class:`ChromiumProcess`). Chromium and all its helpers die with :meth:`ChromiumProcess.close`,
at exit, or when tapml dies.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
from html import escape
from pathlib import Path

from tapml.errors import TapmlError

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = (
    "--headless=new", "--no-sandbox", "--enable-unsafe-webgpu", "--enable-features=Vulkan", "--disable-quic",
    "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-extensions", "--disable-dev-shm-usage",
    "--mute-audio",
)
INSTALL_HINT = ("install Chromium (Debian/Ubuntu: `apt-get install chromium`; it brings SwiftShader Vulkan, "
                "so WebGPU works without a GPU) or point $TAPML_CHROMIUM at a Chromium/Chrome binary")


def find_chromium() -> str:
    """Path of the Chromium to launch: ``$TAPML_CHROMIUM`` or the first of chromium, chromium-browser,
    google-chrome on PATH. Raises TapmlError saying what to install when there is none."""
    explicit = os.environ.get("TAPML_CHROMIUM")
    if explicit:
        path = shutil.which(explicit)
        if not path:
            raise TapmlError(f"$TAPML_CHROMIUM={explicit!r} is not an executable; {INSTALL_HINT}")
        return path
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    raise TapmlError(f"target browser needs Chromium, and none is installed (looked for {', '.join(CHROMIUM_NAMES)} "
                     f"on PATH); {INSTALL_HINT}")


PROFILE_PREFIX = "tapml-chromium-"


def _remove_stale_profiles() -> None:
    """Remove profiles left by tapml processes that were killed (SIGKILL skips cleanup)."""
    import stat
    for profile in Path(tempfile.gettempdir()).glob(PROFILE_PREFIX + "*"):
        try:
            st = profile.lstat()
            if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
                continue  # a link, a file, or another user's: not ours to judge
            owner = _read_pid(profile / "tapml.pid")
            if owner is None:
                continue  # no pid file yet, or not one tapml wrote
            os.kill(owner, 0)
        except ProcessLookupError:
            _remove_profile(str(profile))
        except OSError:
            pass


def _read_pid(path: Path) -> int | None:
    """The pid in a profile's pid file, or None unless it is a small regular file (not a link,
    FIFO or device) holding a positive number."""
    from tapml.io import open_regular
    try:
        fd, _ = open_regular(path, follow_links=False)
    except TapmlError:
        return None
    try:
        text = os.read(fd, 32).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return int(text) if text.isdigit() and 0 < int(text) < 1 << 22 else None


def _remove_profile(profile: str) -> None:
    """Remove a profile and the folder Chromium made beside it in the temp dir
    (``org.chromium.Chromium.*``, holding its singleton socket, which the profile's
    ``SingletonSocket`` link points into); Chromium leaves that folder behind when it is killed."""
    try:
        folder = os.path.dirname(os.readlink(os.path.join(profile, "SingletonSocket")))
    except OSError:
        folder = ""
    if os.path.basename(folder).startswith("org.chromium.") and os.path.isdir(folder):
        shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(profile, ignore_errors=True)


def _write_start_file(profile: str, url: str) -> str:
    """A page in ``profile`` that forwards to ``url``; returns its file:// URL. The file is 0600 in
    the 0700 profile directory, so only this user (and the Chromium it starts) can read the URL."""
    path = os.path.join(profile, "start.html")
    target = escape(url, quote=True)
    page = (f'<!doctype html><meta charset="utf-8"><meta name="referrer" content="no-referrer">'
            f'<meta http-equiv="refresh" content="0; url={target}"><title>tapml</title>')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(page)
    return Path(path).as_uri()


class ChromiumProcess:
    """A headless Chromium on a fresh profile, in its own process group; :meth:`close` kills the
    group and removes the profile. It also dies with tapml (``atexit`` and a parent-death signal).

    ``url`` (which holds the page's one-time token) is never put on Chromium's command line, which
    every local user can read in ``/proc/PID/cmdline``: Chromium opens a start file in its private
    profile directory instead, and that file forwards it to ``url``."""

    def __init__(self, url: str, executable: str | None = None, extra_flags: tuple[str, ...] = ()):
        self.executable = executable or find_chromium()
        _remove_stale_profiles()
        self.profile = tempfile.mkdtemp(prefix=PROFILE_PREFIX)  # mode 0700: other users cannot look inside
        Path(self.profile, "tapml.pid").write_text(str(os.getpid()))
        self.log_path = os.path.join(self.profile, "chromium.log")
        start = _write_start_file(self.profile, url)
        cmd = [self.executable, *CHROMIUM_FLAGS, *extra_flags, f"--user-data-dir={self.profile}", start]
        setpriv = shutil.which("setpriv")
        if setpriv:  # SIGKILL chromium when the thread that started it (the bridge thread) dies
            cmd = [setpriv, "--pdeathsig", "KILL", "--", *cmd]
        env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR") or self.profile}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)
        self.pid = self.proc.pid
        atexit.register(self.close)

    def exited(self) -> str | None:
        """None while Chromium runs, else a sentence saying how it ended."""
        code = self.proc.poll()
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"the browser process {how}"

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def session_pids(self) -> list[int]:
        """Pids of every process still in Chromium's session (its helpers included)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if len(fields) > 3 and int(fields[3]) == self.pid and fields[0] != "Z":
                pids.append(int(entry))
        return pids

    def _gone_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for Chromium and every helper to exit; True when they did."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not self.session_pids():
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        """Terminate Chromium and its helpers, wait for them, remove the profile. Safe to call twice."""
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            for pid in self.session_pids():  # helpers that left the process group but not the session
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            if self._gone_within(grace):
                break
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        _remove_profile(self.profile)
        atexit.unregister(self.close)


__all__ = ["ChromiumProcess", "find_chromium", "CHROMIUM_FLAGS", "INSTALL_HINT"]
