"""The backend contract: the one seam between tapml's checking and a compiler under test.

Version 1 (:data:`CONTRACT_VERSION`). A backend takes a standalone graph -- one carved case, a
region, or the whole model -- as a ``torch.export.ExportedProgram`` whose inputs are all user
inputs (no parameters or buffers: weights arrive as inputs), compiles it for its device, and
runs it on CPU tensors. That is the whole contract; everything else (carving, judging,
migration, journals, reports, repros, remote serving) is tapml's and works over any backend.

tapml's own compilers implement this contract too: :class:`tapml.platforms.wgpu_backend.WgpuBackend`
(tapml's WGSL compiler on wgpu-native) and :class:`tapml.platforms.reference_backend.ReferenceBackend`
(torch eager), both :class:`tapml.platforms.platform_backend.PlatformBackend`; a backend in the
user's own file may extend them. Any backend is adapted to tapml's
:class:`~tapml.platforms.base.Platform` interface by :class:`tapml.platforms.external.BackendPlatform`,
and a backend target runs in a worker process, so a crash of its native code is an ``error`` verdict
and a hang is bounded. (The ``wgpu`` and ``reference`` TARGET forms run those platforms directly:
they keep what the contract does not carry, such as tensors resident on the device between runs.)

A backend is found by its TARGET spec: ``iree:vulkan`` (built in), a prefix registered by an
installed package in the ``tapml.backends`` entry-point group, or ``path/to/file.py:Class`` (that
file's code runs, as a ``file.py:factory`` model spec's does).

Example, a backend that runs the program with torch itself (``tapml replay STORE --target
my_backend.py:EagerBackend``)::

    import torch
    from tapml.platforms.backend import Backend, Compiled

    class EagerBackend(Backend):
        control = None                      # no mature twin of this route to blame against

        def describe(self) -> dict:
            return {"device": "cpu", "version": torch.__version__, "route": "torch eager"}

        def refuse(self, program):
            for node in program.graph.nodes:
                if node.op == "call_function" and "fft" in str(node.target):
                    return f"{node.target} is not supported"
            return None

        def compile(self, program):
            return Compiled(handle=program.module(), artifact=str(program.graph).encode(),
                            artifact_name="graph.txt")

        def run(self, compiled, inputs):
            out = compiled.handle(*inputs)
            return list(out) if isinstance(out, (list, tuple)) else [out]
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tapml.errors import Unsupported

#: The version of this contract; a backend states the one it was written for in ``contract_version``.
CONTRACT_VERSION = 1


class BackendRefused(Unsupported):
    """Raised by :meth:`Backend.compile` when the backend cannot take the program (an op, a dtype,
    a shape it has no lowering for): the case's verdict is ``unsupported`` with this message.

    ``artifact``/``artifact_name``: the backend's own input it failed on (the MLIR a compiler
    rejected), kept for the case's repro. Any exception raised by :meth:`Backend.compile` may
    carry these two attributes; tapml reads them the same way."""

    def __init__(self, message: str, artifact: bytes = b"", artifact_name: str = ""):
        super().__init__(message)
        self.artifact = artifact
        self.artifact_name = artifact_name


@dataclass
class Compiled:
    """What :meth:`Backend.compile` returns.

    ``handle`` is whatever :meth:`Backend.run` needs. ``artifact`` is the backend's own input for
    this program (MLIR, ONNX, WGSL ...) and ``artifact_name`` its file name in a repro folder
    (``"program.mlir"``): a driver engineer reruns the case from it with the backend alone.
    ``blob``, when set, is the compiled form as bytes; with :meth:`Backend.load` it lets the compile
    cache skip compiling on a re-run.
    """

    handle: object
    artifact: bytes = b""
    artifact_name: str = ""
    blob: bytes | None = None


def seconds_per_run(run_once, repeat: int, batches: int = 3) -> float:
    """Seconds one call of ``run_once`` takes: it is called once to warm up, then in ``batches``
    batches of ``repeat`` calls, and the best batch's mean is returned (what
    :meth:`Backend.time_resident` reports; ``run_once`` must return only when the device is done)."""
    repeat = max(1, int(repeat))
    run_once()
    best = float("inf")
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(repeat):
            run_once()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


class Backend:
    """Base class of a compiler under test. Subclass it and implement :meth:`compile` and :meth:`run`.

    ``spec`` is the TARGET spec the backend was opened with (``"iree:vulkan"``). Class attributes:
    ``contract_version`` (the contract it implements), ``forms`` (the specs it accepts; empty:
    any spec with its prefix), ``needs`` (what to install, shown when its imports fail and by
    ``tapml targets``), and ``control`` (the TARGET spec of the same route on a mature device,
    e.g. ``iree:llvm-cpu`` for ``iree:vulkan``; a case that fails here is run there too, to tell
    a fault of the route from one of the device's compiler; None: no control).

    Every method runs in the backend's worker process. An exception from :meth:`compile` is an
    ``unsupported`` verdict carrying its message; one from :meth:`run` an ``error`` verdict.
    """

    contract_version: int = CONTRACT_VERSION
    forms: tuple[str, ...] = ()
    needs: str = ""
    control: str | None = None

    def __init__(self, spec: str):
        self.spec = spec

    def describe(self) -> dict:
        """The device and the software: at least ``device`` (what actually runs the program, as the
        runtime reports it) and ``version`` (the backend's version; it keys the compile cache)."""
        return {"device": "unknown", "version": "0"}

    def refuse(self, program) -> str | None:
        """None when the backend may take ``program`` (an ExportedProgram), else why not: checked
        before compiling, so a known gap costs nothing."""
        return None

    def compile(self, program) -> Compiled:
        """Compile an ExportedProgram for the device. Raise :class:`BackendRefused` (or any
        exception: its message becomes the verdict's) when it cannot."""
        raise NotImplementedError

    def load(self, blob: bytes) -> object:
        """The ``handle`` of a program compiled earlier, from its :attr:`Compiled.blob` (only called
        when :meth:`compile` gave one)."""
        raise NotImplementedError

    def run(self, compiled: Compiled, inputs: list) -> list:
        """Run a compiled program on CPU tensors (the program's user inputs, in order); returns CPU
        tensors, one per program output, in order."""
        raise NotImplementedError

    def time_resident(self, compiled: Compiled, inputs: list, repeat: int) -> float | None:
        """Optional: seconds one run of ``compiled`` takes with ``inputs`` already on the backend's
        device and the outputs left there, each run launched and waited for alone (wall clock; the
        best of a few batches of ``repeat`` runs). ``tapml bench --target A --target B`` puts it beside
        every target's run time, so compilers compare without their host transfers.
        :func:`seconds_per_run` does the timing around one run. None (the default): the backend cannot tell."""
        return None

    def repro_runner(self) -> str | None:
        """Python source of a module that runs this backend's :attr:`Compiled.artifact` with the
        backend's own package alone, for ``tapml repro`` folders: it defines ``run(artifact: bytes,
        inputs: list, dtypes: list[str]) -> list`` (numpy arrays in and out; bfloat16 travels as
        float32). None (the default): the repro's script re-imports this class and compiles the saved
        program (it needs torch, tapml's contract module and this backend)."""
        return None

    def repro_page(self) -> dict[str, str] | None:
        """For a compiler that runs in a browser: the files of a page that runs a repro folder's
        :attr:`Compiled.artifact` with the backend's own web runtime alone, ``{"index.html": ..., NAME: ...}``
        (plain file names). ``tapml repro`` writes them into the folder with ``check.js``, the repro pages'
        shared script (the folder's files, ``.npy`` parsing, tapml's comparison rule, PASS/FAIL display), which
        the page loads first. None (the default): no page."""
        return None

    def close(self) -> None:
        """Release the device. Called once, when the worker ends."""


__all__ = ["CONTRACT_VERSION", "Backend", "BackendRefused", "Compiled", "seconds_per_run"]
