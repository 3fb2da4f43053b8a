"""The device of a ``tapml serve`` in a process of its own, which the server can kill.

A GPU dispatch (or a torch op) cannot be interrupted from Python, and a shader can loop for as
long as it likes within any invocation count. So the server never touches its device itself:
:class:`WorkerPlatform` forwards caps/supports/compile/run to a child process
(``python -m tapml.remote.device_worker FD SPEC``) over a socket pair, and when a call runs past
its deadline, or the worker dies, it kills the worker (SIGKILL; the device's threads and memory
go with it) and starts a fresh one on the next call. The server's own threads stay free to
answer other clients and signals.

Between parent and worker: a frame is an 8-byte length and a JSON object; tensors follow as
bulk messages of :mod:`tapml.remote.protocol`. No pickle. The parent is a
:class:`~tapml.platforms.base.RuntimePlatform`: its prepared programs are the ones the worker
holds (a compile leaves its program there; ``_prepare`` loads one compiled elsewhere), and both
sides keep them in a :class:`~tapml.platforms.program_cache.ProgramCache` of the same limits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings

from tapml.errors import DeviceLost, PlatformError, TapmlError, Unsupported
from tapml.platforms.base import KernelProgram, ResidentTensor, RuntimePlatform, seconds_or_none, wrap_errors
from tapml.platforms.program_cache import ProgramCache
from tapml.remote import protocol as P

_LEN = struct.Struct("!Q")
MAX_FRAME = 1 << 30
STARTUP_TIMEOUT_S = 120.0
#: Seconds a closed worker gets to close its platform and exit before it is killed.
CLOSE_GRACE_S = 5.0
#: the most runs one ``time_resident`` request may ask of the worker
MAX_TIMED_REPEAT = 100


class _StateLost(Exception):
    pass


class RunTimeout(PlatformError):
    """A compile or run took longer than the server's wall-clock limit; its worker was killed."""


def _send(sock: socket.socket, obj: dict, tensors=()) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)
    for t in tensors:
        P.send_tensor(sock, P.TENSOR, 0, t)


def _recv(sock: socket.socket, deadline: float | None = None) -> dict:
    (n,) = _LEN.unpack(P.recv_exact(sock, _LEN.size, deadline))
    if n > MAX_FRAME:
        raise P.ProtocolError(f"worker frame of {n} bytes")
    return json.loads(P.recv_exact(sock, n, deadline))


def _recv_tensors(sock: socket.socket, count: int, deadline: float | None = None) -> list:
    out = []
    for _ in range(count):
        if deadline is not None:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        _, _, dtype, shape, nbytes = P.recv_header(sock, 1 << 62)
        if deadline is not None:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        out.append(P.tensor_from(dtype, shape, P.recv_payload(sock, nbytes)))
    return out


class _UnknownProgram(Exception):
    pass


class _UnknownInput(Exception):
    pass


#: a run's inputs the worker keeps (the last tensor of each input of each program) and kept
#: outputs are lost with the worker; this is what a run that names one is told
WORKER_STATE_LOST = ("the device server's worker no longer holds that resident tensor: the worker was restarted "
                     "(a run passed tapml serve --run-timeout, or it crashed) and its device state went with it, "
                     "or it dropped the program that made it (raise TAPML_PROGRAM_CACHE); run the generation "
                     "again from its first step")


class WorkerPlatform(RuntimePlatform):
    """A platform spec (``reference``, ``wgpu:vulkan``, ...) opened in a killable child process.

    ``timeout`` bounds every compile and run in seconds: past it the worker is killed and the
    call raises :class:`RunTimeout`; the next call starts a fresh worker. ``memory_headroom``
    (bytes): the worker's address space may grow by at most this much past what it maps once its
    device is open (``RLIMIT_AS``), so an allocation past it fails in the worker (an error for that
    call) instead of taking the machine's memory. Raises TapmlError
    when the worker cannot open the device (the message says why).

    Example::

        with WorkerPlatform("wgpu:vulkan", timeout=60) as p:
            outputs = p.run(p.compile(graph), inputs)
    """

    program_kinds = ("wgsl", "graph")

    def __init__(self, spec: str, timeout: float = 120.0, address_space: int | None = None,
                 memory_headroom: int | None = None):
        self.spec = self.name = spec
        self.timeout = timeout
        self.address_space = address_space
        self.memory_headroom = memory_headroom
        super().__init__()  # self.programs: keys of the programs the current worker holds
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._caps_cache: dict | None = None
        self._lock = threading.Lock()
        self.restarts = 0
        self.last_run_ms = self._device_ms = None
        #: an external backend's last compile (None elsewhere): its time, whether it came from the
        #: on-disk compile cache, and ``(file name, bytes)`` of the backend's own input for it
        self.last_compile_ms = None
        self.last_compile_cached = False
        self.last_artifact: tuple[str, bytes] | None = None
        self._worker = 0  # which worker process: state kept in one is gone in the next
        # the input tensors the current worker holds per program (position -> (tensor, _version)),
        # so an unmodified tensor is not sent again, and the worker that holds each kept output
        self._sent: dict[str, dict[int, tuple]] = {}
        self._kept: dict[tuple[str, int], int] = {}
        with self._lock:
            self._start()

    # --- the worker process ---------------------------------------------------------------
    def _start(self) -> None:
        parent, child = socket.socketpair()
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "tapml.remote.device_worker", str(child.fileno()),
                                           self.spec, str(int(self.address_space or 0)),
                                           str(int(self.memory_headroom or 0))],
                                          pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._sock = parent
        self._worker += 1
        self.programs.clear()  # a fresh worker holds no programs, inputs or kept outputs
        self._sent.clear()
        self._kept.clear()
        try:
            hello = _recv(parent, time.monotonic() + STARTUP_TIMEOUT_S)
        except (OSError, EOFError, ValueError, P.ProtocolError) as e:
            self._kill()
            raise TapmlError(f"the device worker for {self.spec} did not start: {e}") from None
        if "error" in hello:
            self._kill()
            raise TapmlError(hello["error"]["message"])
        self._caps_cache = hello["caps"]

    def _kill(self) -> None:
        proc, sock = self._proc, self._sock
        self._proc = self._sock = None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if sock is not None:
            sock.close()

    def _ensure_worker(self) -> None:
        """Start a fresh worker when there is none or it died (under the lock)."""
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:
                self._kill()
            self.restarts += 1
            try:
                self._start()
            except TapmlError as e:
                raise DeviceLost(str(e)) from None

    def _call(self, request: dict, tensors=(), what: str = "call", worker: int | None = None) -> tuple[dict, list]:
        """One request; ``worker``: the worker the request was built for (it names state kept
        there): when that one is gone, PlatformError instead of asking a fresh one."""
        with self._lock:
            self._ensure_worker()
            if worker is not None and worker != self._worker:
                raise _StateLost(WORKER_STATE_LOST)
            deadline = time.monotonic() + self.timeout
            try:
                reply, outputs = self._exchange(request, tensors, deadline)
            except (TimeoutError, socket.timeout):
                self._kill()
                raise RunTimeout(f"the {what} ran past this server's limit of {self.timeout:g} s "
                                 "(tapml serve --run-timeout) and was stopped") from None
            except (OSError, EOFError, ValueError, P.ProtocolError) as e:
                code = self._proc.poll() if self._proc else None
                self._kill()
                why = f"signal {-code}" if code is not None and code < 0 else f"exit {code}" if code is not None else e
                lost = "" if worker is None else (" with the device state it kept (resident tensors); run the "
                                                  "generation again from its first step")
                raise PlatformError(f"the device worker died during the {what} ({why}); "
                                    f"it is restarted for the next request{lost}") from None
        if request.get("op") == "compile":
            self._record_compile(reply, outputs)
        if "error" in reply:
            kind, message = reply["error"].get("kind"), reply["error"].get("message", "")
            if kind == "unknown-program":
                raise _UnknownProgram(message)
            if kind == "unknown-input":
                raise _UnknownInput(message)
            if kind == "unknown-resident":
                raise PlatformError(WORKER_STATE_LOST)
            raise (Unsupported if kind == "unsupported" else ValueError if kind == "usage" else PlatformError)(message)
        return reply, outputs

    def _record_compile(self, reply: dict, outputs: list) -> None:
        """An external backend's compile facts from the worker's reply (see :func:`_compile_facts`)."""
        ms = reply.get("compile_ms")
        self.last_compile_ms = float(ms) if isinstance(ms, (int, float)) and not isinstance(ms, bool) else None
        self.last_compile_cached = reply.get("compile_cached") is True
        name = reply.get("artifact_name")
        self.last_artifact = None
        if isinstance(name, str) and len(outputs) == 1 and str(outputs[0].dtype) == "torch.uint8":
            self.last_artifact = (name, outputs[0].numpy().tobytes())

    def _exchange(self, request: dict, tensors, deadline: float) -> tuple[dict, list]:
        self._sock.settimeout(max(0.001, deadline - time.monotonic()))
        _send(self._sock, request, tensors)
        reply = _recv(self._sock, deadline)
        return reply, _recv_tensors(self._sock, int(reply.get("tensors", 0)), deadline)

    # --- Platform -------------------------------------------------------------------------
    def _caps(self) -> dict:
        if self._caps_cache is None:
            self._call({"op": "caps"})
        return dict(self._caps_cache)

    def _supports(self, node) -> str | None:
        return self._call({"op": "supports", "node": node.to_json()})[0].get("reason") or None

    def compile(self, graph):
        """Compile ``graph`` in the worker (which checks support node by node itself)."""
        return wrap_errors(self._compile, graph)

    def _compile(self, graph) -> KernelProgram:
        self.last_compile_ms, self.last_compile_cached, self.last_artifact = None, False, None
        reply, _ = self._call({"op": "compile", "graph": graph.to_json()}, what="compile")
        program = KernelProgram.from_json(reply["program"])
        self.programs.put(program.key, True)  # the worker that compiled it keeps it (else: unknown-program, resent)
        return program

    def run(self, program: KernelProgram, inputs: list, keep=()):
        """Run ``program`` in the worker; ``last_run_ms`` is the worker's own time for it."""
        out = super().run(program, inputs, keep)
        self.last_run_ms = self._device_ms
        return out

    def _prepare(self, program: KernelProgram) -> tuple[bool, int]:
        """Hand the worker a program compiled elsewhere (it checks and keeps it; no device work)."""
        self._call({"op": "load", "program": program.to_json()}, what="load")
        return True, 0

    def _execute(self, program: KernelProgram, prepared, inputs: list) -> list:
        return self._run_in_worker(program, inputs, [])

    def _run_resident(self, program: KernelProgram, inputs: list, keep: list[int]) -> list:
        """Resident inputs are named to the worker, which holds them (the device's own
        ResidentTensors); kept outputs stay there."""
        return self._run_in_worker(program, inputs, keep)

    def _run_in_worker(self, program: KernelProgram, inputs: list, keep: list[int]) -> list:
        """A run whose inputs cross only when the worker does not hold them already: an
        unmodified tensor sent for the same input before (weights) is named, not sent; a
        resident tensor is named by the program and output that made it."""
        for _attempt in range(3):
            with self._lock:
                self._ensure_worker()
                worker = self._worker
                held = self._sent.get(program.key, {})
                args, tensors, sent = [], [], {}
                for pos, t in enumerate(inputs):
                    if isinstance(t, ResidentTensor):
                        if self._kept.get((t.program, t.output)) != worker:
                            raise PlatformError(WORKER_STATE_LOST)
                        args.append(["resident", t.program, t.output])
                    elif (last := held.get(pos)) is not None and last[0] is t and last[1] == t._version:
                        args.append("held")
                    else:
                        args.append("t")
                        tensors.append(t)
                        sent[pos] = (t, t._version)
            if program.key not in self.programs:
                self.prepared(program)
            request = {"op": "run", "key": program.key, "inputs": len(tensors), "args": args, "keep": list(keep)}
            names_state = any(a != "t" for a in args)  # then only the worker it was built for may run it
            try:
                reply, outputs = self._call(request, tensors, what="run", worker=worker if names_state else None)
            except _UnknownProgram:  # the worker dropped it: nothing ran, send it again
                self.forget(program.key)
                self._sent.pop(program.key, None)
                continue
            except _UnknownInput:  # the worker dropped what it held for it: send every input
                self._sent.pop(program.key, None)
                continue
            except _StateLost:
                raise PlatformError(WORKER_STATE_LOST) from None
            except BaseException:  # noqa: B036 - forget, then re-raise whatever it was
                self._forget_state(program.key)
                raise
            held = self._sent.setdefault(program.key, held)
            for pos, t in enumerate(inputs):
                if isinstance(t, ResidentTensor):
                    held.pop(pos, None)
            held.update(sent)
            for i in range(len(program.outputs)):
                if i in keep:
                    self._kept[(program.key, i)] = worker
                else:
                    self._kept.pop((program.key, i), None)
            self._device_ms = reply.get("device_ms")
            self.last_wide = P.two_word_refs(reply.get("int64_two_words"))
            out = iter(outputs)
            return [None if i in keep else next(out) for i in range(len(program.outputs))]
        raise PlatformError(f"the device worker kept dropping program {program.key[:12]} (its program cache is "
                            "too small for it; raise TAPML_PROGRAM_CACHE / TAPML_PROGRAM_CACHE_MIB)")

    def time_resident(self, program: KernelProgram, inputs: list, repeat: int = 3) -> float | None:
        """The worker's platform's :meth:`time_resident` for ``program`` (seconds per run with the
        inputs on its device); None when that platform cannot tell."""
        for _attempt in range(2):
            if program.key not in self.programs:
                self.prepared(program)
            try:
                reply, _ = self._call({"op": "time_resident", "key": program.key, "inputs": len(inputs),
                                       "repeat": int(repeat)}, list(inputs), what="timing")
            except _UnknownProgram:  # a restarted worker: hand it the program again
                self.forget(program.key)
                continue
            return seconds_or_none(reply.get("seconds"))
        raise PlatformError(f"the device worker kept dropping program {program.key[:12]}")

    def _forget_state(self, key: str) -> None:
        """A failed run leaves the program's buffers unknown: rely on nothing it held."""
        self._sent.pop(key, None)
        for k in [k for k in self._kept if k[0] == key]:
            del self._kept[k]

    def _release(self, key: str, prepared) -> None:
        self._forget_state(key)

    def _read_resident(self, handle):
        with self._lock:
            self._ensure_worker()
            worker = self._worker
            if self._kept.get((handle.program, handle.output)) != worker:
                raise PlatformError(WORKER_STATE_LOST)
        try:
            _, outputs = self._call({"op": "read", "key": handle.program, "output": handle.output},
                                    what="read", worker=worker)
        except _StateLost:
            raise PlatformError(WORKER_STATE_LOST) from None
        return outputs[0]

    def close(self) -> None:
        """End the worker: its socket is closed, so that it closes its platform (a browser the platform
        started, and that browser's profile) and exits; one that has not exited within
        :data:`CLOSE_GRACE_S` (busy with a call in flight) is killed."""
        proc, sock = self._proc, self._sock
        if proc is not None and sock is not None and proc.poll() is None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
                proc.wait(CLOSE_GRACE_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()


# --- the worker side ------------------------------------------------------------------------

def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the server
    except (OSError, AttributeError):
        pass


def _error(kind: str, e: BaseException) -> dict:
    return {"error": {"kind": kind, "message": str(e) if kind != "platform" or isinstance(e, PlatformError)
                      else f"{type(e).__name__}: {e}"}}


def _limit_address_space(address_space: int, headroom: int) -> None:
    """RLIMIT_AS of this process: at most ``address_space`` bytes, and at most what it maps now plus
    ``headroom`` bytes (0: no such bound). An allocation past it fails (MemoryError, a torch or driver
    error: the request's error) instead of growing the machine's memory without bound."""
    import resource
    limits = [address_space] if address_space > 0 else []
    if headroom > 0:
        try:
            with open("/proc/self/statm") as f:
                limits.append(int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + headroom)
        except (OSError, ValueError, IndexError):
            pass
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if limits and hard != resource.RLIM_INFINITY:
        limits.append(hard)  # never above a limit already set: that would raise the hard limit
    if limits:
        resource.setrlimit(resource.RLIMIT_AS, (min(limits), min(limits)))


def worker_main(fd: int, spec: str, address_space: int = 0, memory_headroom: int = 0) -> None:
    """Open ``spec`` and answer the parent on socket ``fd`` until it closes; ``address_space``:
    the worker's RLIMIT_AS in bytes, ``memory_headroom``: how far its address space may grow past
    what it maps once the platform is open (0: no bound)."""
    _die_with_parent()
    _limit_address_space(address_space, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    # its stderr is the user's terminal: library deprecation chatter (torch's pytree, on every
    # exported program) is not for them, as in the commands themselves
    warnings.filterwarnings("ignore")
    sock = socket.socket(fileno=fd)
    from tapml.platforms.targets import open_platform
    try:
        platform = open_platform(spec)
        caps = platform.caps()
    except TapmlError as e:
        _send(sock, _error("usage", e))
        return
    except Exception as e:  # noqa: BLE001 - the parent reports it
        _send(sock, _error("platform", e))
        return
    _limit_address_space(0, memory_headroom)  # past what the opened platform maps
    _send(sock, {"caps": caps})
    held = ProgramCache()  # program key -> the tensors of its last run's inputs (what "held" names)
    kept: dict[tuple[str, int], object] = {}  # (program key, output) -> the platform's ResidentTensor

    def forget(key: str, _program=None) -> None:
        held.pop(key)
        for k in [k for k in kept if k[0] == key]:
            del kept[k]

    # the same limits as the parent's record of what this worker holds
    programs = ProgramCache(on_evict=forget)
    try:
        _serve_parent(sock, platform, programs, held, kept, forget)
    finally:  # the parent closed the socket (or went away): release the device, as the platform contract says
        try:
            platform.close()
        except Exception:  # noqa: BLE001 - the worker ends anyway
            pass


def _serve_parent(sock, platform, programs, held, kept, forget) -> None:
    """Answer the parent's requests on ``sock`` until it closes."""
    from tapml.graph import Graph, Node
    while True:
        try:
            req = _recv(sock)
        except (OSError, EOFError):
            return
        op, outputs, payloads = req.get("op"), [], []
        try:
            # a run's inputs follow its frame whatever becomes of it: read them first
            inputs = _recv_tensors(sock, int(req.get("inputs", 0))) if op in ("run", "time_resident") else []
        except (OSError, EOFError, ValueError, P.ProtocolError):
            return
        try:
            if op == "caps":
                reply = {"caps": platform.caps()}
            elif op == "supports":
                reply = {"reason": platform.supports(Node.from_json(req["node"]))}
            elif op == "compile":
                if hasattr(platform, "last_artifact"):
                    platform.last_artifact = None
                program = platform.compile(Graph.from_json(req["graph"]))
                programs.put(program.key, program)
                reply = {"program": program.to_json()}
            elif op == "load":
                program = KernelProgram.from_json(req["program"])
                programs.put(program.key, program)
                reply = {"key": program.key}
            elif op in ("run", "read", "time_resident") and (program := programs.get(req["key"])) is None:
                reply = {"error": {"kind": "unknown-program", "message": "send the program"}}
            elif op == "run":
                args, keep = _run_args(req, inputs, held.get(program.key) or [], kept)
                try:
                    outputs = platform.run(program, args, keep=keep)
                except BaseException:
                    forget(program.key)  # its buffers are unknown after a failed run
                    raise
                held.put(program.key, [None if isinstance(t, ResidentTensor) else t for t in args],
                         sum(t.nbytes for t in args if not isinstance(t, ResidentTensor)))
                for i in range(len(outputs)):
                    kept.pop((program.key, i), None)
                kept.update({(program.key, i): outputs[i] for i in keep})
                payloads = [P.tensor_bytes(t) for i, t in enumerate(outputs) if i not in keep]
                reply = {"tensors": len(payloads), "device_ms": getattr(platform, "last_run_ms", None),
                         "int64_two_words": list(getattr(platform, "last_wide", ()) or ())}
            elif op == "time_resident":
                timer = getattr(platform, "time_resident", None)
                repeat = min(max(int(req.get("repeat", 3)), 1), MAX_TIMED_REPEAT)
                reply = {"seconds": timer(program, inputs, repeat) if callable(timer) else None}
            elif op == "read":
                handle = kept.get((program.key, req["output"]))
                if handle is None:
                    raise _NotHeld("unknown-resident")
                payloads = [P.tensor_bytes(platform.read(handle))]
                reply = {"tensors": 1}
            else:
                reply = _error("usage", ValueError(f"unknown worker request {op!r}"))
        except _NotHeld as e:
            reply = {"error": {"kind": str(e), "message": "not held by this worker"}}
        except Unsupported as e:
            reply = _error("unsupported", e)
        except (TypeError, ValueError, KeyError) as e:
            reply = _error("usage", e)
        except Exception as e:  # noqa: BLE001 - the verdict of the request, not the worker's end
            reply = _error("platform", e)
        if op == "compile":
            payloads = _compile_facts(platform, reply)
        del inputs, outputs
        try:
            _send(sock, reply)
            for dtype, shape, payload in (payloads if "error" not in reply or op == "compile" else ()):
                P.send_message(sock, P.TENSOR, 0, payload, dtype, shape)
        except OSError:
            return


def _compile_facts(platform, reply: dict) -> list:
    """What a compile reply adds for an external backend (:class:`~tapml.platforms.external.BackendPlatform`),
    whether the compile went through or not: ``compile_ms`` and ``compile_cached``, and its artifact
    (the backend's own input) named by ``artifact_name`` and sent as one uint8 tensor after the frame."""
    import torch
    if getattr(platform, "last_compile_ms", None) is not None:
        reply["compile_ms"] = float(platform.last_compile_ms)
        reply["compile_cached"] = bool(getattr(platform, "last_compile_cached", False))
    artifact = getattr(platform, "last_artifact", None)
    if not artifact:
        return []
    name, data = artifact
    reply["artifact_name"], reply["tensors"] = str(name), 1
    return [P.tensor_bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                           torch.empty(0, dtype=torch.uint8))]


class _NotHeld(Exception):
    """A run names an input or a resident tensor this worker does not hold (its kind)."""


def _run_args(req: dict, inputs: list, held: list, kept: dict) -> tuple[list, list[int]]:
    """A run's inputs (tensors sent with it, held from the last run, resident) and its keep list."""
    args = req.get("args", ["t"] * len(inputs))
    keep = req.get("keep", [])
    if not isinstance(args, list) or not isinstance(keep, list) or not all(type(i) is int for i in keep):
        raise ValueError("malformed run request")
    if sum(a == "t" for a in args) != len(inputs):
        raise ValueError(f"run names {sum(a == 't' for a in args)} sent tensors, {len(inputs)} came")
    sent = iter(inputs)
    out = []
    for pos, a in enumerate(args):
        if a == "t":
            out.append(next(sent))
        elif a == "held":
            if pos >= len(held) or held[pos] is None:
                raise _NotHeld("unknown-input")
            out.append(held[pos])
        elif isinstance(a, list) and len(a) == 3 and a[0] == "resident":
            handle = kept.get((a[1], a[2]))
            if handle is None:
                raise _NotHeld("unknown-resident")
            out.append(handle)
        else:
            raise ValueError(f"malformed run argument {str(a)[:40]}")
    return out, keep


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), sys.argv[2], *(int(a) for a in sys.argv[3:5]))
    # the platform is closed: the interpreter's teardown (torch and the device libraries) is only time the
    # parent would wait for
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
