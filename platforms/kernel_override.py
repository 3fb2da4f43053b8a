"""KernelOverridePlatform: a WGSL target on which the user's own kernels replace tapml's lowering of
their ops (``--kernel OP=FILE.wgsl``; the convention is :mod:`tapml.platforms.wgsl.user_kernels`).

A graph that holds an overridden op is compiled here, on the host, for the device's caps, and the
program (the user's WGSL inside it, verbatim) goes to the wrapped platform to run, as any program
compiled elsewhere does: wgpu-native in-process, a browser page, a device server (which checks it
like every program it is sent). Other graphs compile on the wrapped platform as before. Each file
is first compiled alone on the device (a pipeline, no dispatch): a file the device's compiler
refuses makes every case that uses it ``unsupported``, with the device's message and the file.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Mapping

from tapml.errors import DeviceLost, PlatformError, TapmlError, Unsupported
from tapml.graph import Graph, Node
from tapml.platforms.base import KernelProgram, Platform, PlatformWrapper
from tapml.platforms.program_cache import ProgramCache

#: Programs with user kernels kept compiled (by graph), as WgslPlatform keeps its own.
COMPILED_PROGRAMS = 512


class KernelOverridePlatform(PlatformWrapper):
    """``inner`` (a platform that runs WGSL KernelPrograms) with ``kernels`` (``{op: (UserKernel,
    ...)}``, from :func:`~tapml.platforms.wgsl.user_kernels.parse_kernel_options`) in place of
    tapml's lowerings of those ops. TapmlError when ``inner`` runs no WGSL (a reference, an
    external backend, a device server that runs torch).

    Example::

        kernels = parse_kernel_options(["aten.gelu.default=examples/kernels/gelu.wgsl"])
        platform = KernelOverridePlatform(WgpuPlatform("vulkan"), kernels)
    """

    def __init__(self, inner: Platform, kernels: Mapping[str, tuple]):
        from tapml.platforms.wgsl.user_kernels import user_lowerings
        super().__init__(inner)
        kinds = getattr(inner, "program_kinds", ())
        backend = str((inner.caps() or {}).get("backend", ""))
        if "wgsl" not in kinds or backend.startswith("torch"):
            raise TapmlError(f"--kernel replaces a lowering of tapml's WGSL compiler, and {inner.name} runs no WGSL; "
                             "use it on wgpu, wgpu:vulkan, wgpu:gl, browser or a remote:// WGSL device server")
        self.kernels = dict(kernels)
        self.lowerings = user_lowerings(self.kernels)
        self._verdicts: dict[str, str] = {}  # source digest -> "" (compiles here) or the device's message
        self._compiled = ProgramCache(max_entries=COMPILED_PROGRAMS)

    def _supports(self, node: Node) -> str | None:
        if node.op in self.kernels:
            return None  # the user's kernel decides, when a case's tensors are known (compile)
        return self.inner.supports(node)

    def _compile(self, graph: Graph) -> KernelProgram:
        if not any(node.op in self.kernels for node in graph.nodes):
            return self.inner.compile(graph)
        from tapml.platforms.wgsl import compile_graph
        caps = self.inner.caps()
        key = hashlib.sha256(json.dumps([graph.to_json(), caps], sort_keys=True, default=str).encode()).hexdigest()
        program = self._compiled.get(key)
        if program is None:
            program = compile_graph(graph, caps, self.lowerings)
            sources = {kern.wgsl for kern in program.kernels}
            for op, files in self.kernels.items():
                for kernel in files:
                    if kernel.source in sources:
                        self._check_on_device(kernel)
            self._compiled.put(key, program, sum(len(b.data or b"") for b in program.buffers))
        return program

    def _check_on_device(self, kernel) -> None:
        """Unsupported, with the device's own message, when the device cannot compile ``kernel``."""
        from tapml.platforms.wgsl.user_kernels import probe_program, source_digest
        digest = source_digest(kernel)
        if digest not in self._verdicts:
            try:
                self.inner.run(probe_program(kernel), [])
                self._verdicts[digest] = ""
            except DeviceLost:
                raise
            except (PlatformError, Unsupported) as e:
                message = str(e).split("\n--- shader ---")[0].strip()
                self._verdicts[digest] = re.sub(r"^WGSL compile (failed on \S+|error): ", "", message)
        message = self._verdicts[digest]
        if message:
            raise Unsupported(f"{kernel.op}: --kernel {kernel.label} does not compile on {self.name}: {message}")


__all__ = ["KernelOverridePlatform"]
