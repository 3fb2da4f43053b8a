"""tapml's own platforms behind the :class:`~tapml.platforms.backend.Backend` contract.

:class:`PlatformBackend` is the other direction of :class:`tapml.platforms.external.BackendPlatform`:
it takes the ExportedProgram the contract hands a backend, turns it into tapml's
:class:`~tapml.graph.Graph` with :func:`tapml.graph.graph_from_fx` (the converter carving uses),
and compiles and runs it on one of tapml's platforms, opened from its TARGET form
(:func:`tapml.platforms.targets.open_platform`). What is particular to that platform (WGSL kernels,
bindings, parts, resident buffers) stays behind it: the contract sees a program in, tensors out.
:class:`tapml.platforms.wgpu_backend.WgpuBackend` and
:class:`tapml.platforms.reference_backend.ReferenceBackend` are its two kinds.
"""

from __future__ import annotations

from tapml.graph import Graph, graph_from_fx
from tapml.platforms.backend import Backend, BackendRefused, Compiled


class PlatformBackend(Backend):
    """A tapml platform as a :class:`Backend`. Subclasses set ``forms`` (the TARGET forms of the
    platform they open), ``default_form`` (the form opened when the backend's spec is none of them:
    a ``path/file.py:Class`` subclass's) and may override :meth:`artifact`.

    The platform is opened by the constructor (``self.platform``); ``refuse`` names the first node
    the platform has no lowering for; ``compile`` returns the platform's program as the handle.
    """

    default_form: str = ""

    def __init__(self, spec: str):
        from tapml.platforms.targets import open_platform
        super().__init__(spec)
        self.form = spec if spec in self.forms else self.default_form
        self.platform = open_platform(self.form)

    def describe(self) -> dict:
        from tapml import version
        caps = self.platform.caps()
        return {"device": caps.get("adapter", "unknown"),
                "version": f"tapml {version()} {caps.get('backend', '')}".strip(),
                "route": f"tapml's own compiler ({self.form})", "features": list(caps.get("features", [])),
                "limits": dict(caps.get("limits", {}))}

    def to_graph(self, program) -> Graph:
        """tapml's Graph of an ExportedProgram, converted afresh each time (a subclass may change the
        program between ``refuse`` and ``compile``); BackendRefused naming the node for what tapml's
        vocabulary cannot represent."""
        try:
            return graph_from_fx(program.graph)
        except ValueError as e:
            raise BackendRefused(str(e)) from None

    def refuse(self, program) -> str | None:
        try:
            graph = self.to_graph(program)
        except BackendRefused as e:
            return str(e)
        for node in graph.nodes:
            reason = self.platform.supports(node)
            if reason:
                return f"{node.op} (node {node.name}): {reason}"
        return None

    def compile(self, program) -> Compiled:
        compiled = self.platform.compile(self.to_graph(program))
        name, artifact = self.artifact(compiled)
        return Compiled(handle=compiled, artifact=artifact, artifact_name=name)

    def artifact(self, compiled) -> tuple[str, bytes]:
        """``(file name, bytes)`` of the platform's program for repros: its JSON by default."""
        return "program.json", compiled.dumps().encode()

    def run(self, compiled: Compiled, inputs: list) -> list:
        return self.platform.run(compiled.handle, list(inputs))

    def close(self) -> None:
        self.platform.close()


__all__ = ["PlatformBackend"]
