"""The reference (torch eager) as a :class:`~tapml.platforms.backend.Backend`.

``ReferenceBackend("reference")`` runs each program op by op with torch on the CPU
(``reference:cuda``: on CUDA) through :class:`~tapml.platforms.reference.ReferencePlatform`, only
ops of tapml's closed vocabulary; its artifact is the program's graph as JSON (``graph.json``).
"""

from __future__ import annotations

import json

from tapml.platforms.platform_backend import PlatformBackend


class ReferenceBackend(PlatformBackend):
    """torch eager on the CPU (``reference``, ``reference:cpu``) or CUDA (``reference:cuda``)."""

    forms = ("reference", "reference:cpu", "reference:cuda")
    default_form = "reference"
    needs = "torch"

    def artifact(self, compiled) -> tuple[str, bytes]:
        return "graph.json", json.dumps(compiled.graph, indent=1).encode()


__all__ = ["ReferenceBackend"]
