"""ONNX Runtime as a compiler under test: the ``ort`` TARGET (its CPU execution provider).

The route: the ExportedProgram -> torch's ONNX exporter (``torch.onnx.export(..., dynamo=True)``'s
translation, onnxscript's torchlib) -> ONNX bytes (the repro's ``model.onnx``, and the blob the
compile cache keeps) -> ``onnxruntime.InferenceSession`` on the provider asked for -> outputs.

Three things the route does that a user must see rather than have hidden:

- ONNX Runtime falls back to its CPU provider without a word when the provider asked for cannot
  take the session (its WebGPU provider finds no adapter on lavapipe): :meth:`OrtBackend.compile`
  holds ``session.get_providers()`` to :attr:`OrtBackend.provider` and refuses the program otherwise.
- The exporter may change an output's dtype (it drops the final float16 cast of a ``sum``, so the
  output comes back float32): outputs are returned as ONNX Runtime made them, never cast back, so
  the comparison reports the changed dtype as a mismatch naming both dtypes.
- ONNX Runtime's CPU provider has few bfloat16 (and some float16) kernels: a program it has no
  kernel for is refused with the ONNX op, its input dtypes and the node, an ``unsupported`` verdict.

The ONNX route's mature device is this CPU provider itself, so ``ort`` has no control; a backend on
the same route with another provider (a future ``ort-web``: onnxruntime-web on WebGPU in Chromium)
names ``control = "ort"``, and a case that fails there and here too is the exporter's fault.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tapml.platforms.backend import Backend, BackendRefused, Compiled
from tapml.platforms.onnx_route import ONNX_DTYPES, SIGNATURE_KEY, feed_names, node_types, onnx_model, opset, read_signature, refuse_dtypes


@dataclass
class OrtProgram:
    """A session ready to run: ``inputs`` is the session input fed from each program input (None
    where the ONNX model dropped an unused one), ``outputs`` the number of program outputs."""

    session: object
    inputs: list[str | None]
    outputs: int


class OrtBackend(Backend):
    """ONNX Runtime on its CPU execution provider (TARGET ``ort``).

    A subclass for another provider changes :attr:`provider` and :attr:`device` (and ``forms``, ``control``): the
    check that the session really runs on it, the refusals and the dtype handling stay the same.
    """

    forms = ("ort",)
    needs = "onnxruntime, onnx and onnxscript: pip install 'tapml[backends]' (the README's setup installs them)"
    control = None  # ORT's CPU provider IS the ONNX route's control; see the module docstring
    #: The execution provider the session must run on, and the device it runs on.
    provider = "CPUExecutionProvider"
    device = "cpu"

    def __init__(self, spec: str):
        super().__init__(spec)
        import onnxruntime
        self._ort = onnxruntime
        if self.provider not in onnxruntime.get_available_providers():
            raise BackendRefused(f"this onnxruntime ({onnxruntime.__version__}) has no {self.provider}; "
                                 f"it has {', '.join(onnxruntime.get_available_providers())}")

    def describe(self) -> dict:
        import onnx
        import onnxscript
        ort = self._ort
        return {"device": f"{self.device} ({self.provider})", "providers": [self.provider],
                "available_providers": ort.get_available_providers(),
                "onnxruntime": ort.__version__, "onnx": onnx.__version__, "onnxscript": onnxscript.__version__,
                "opset": opset(), "route": "torch.onnx exporter (dynamo) -> ONNX -> onnxruntime",
                # the exporter's torch and onnxscript make the ONNX; onnxruntime runs it: all key the compile cache
                "version": f"onnxruntime {ort.__version__}, torch {torch.__version__}, onnxscript {onnxscript.__version__}, "
                           f"opset {opset()}"}

    def refuse(self, program) -> str | None:
        return refuse_dtypes(program)

    def compile(self, program) -> Compiled:
        model, signature = onnx_model(program)
        return Compiled(handle=self._session(model, signature), artifact=model, artifact_name="model.onnx", blob=model)

    def load(self, blob: bytes) -> OrtProgram:
        """A session from the ONNX bytes :meth:`compile` made (its signature in the model's metadata)."""
        return self._session(blob, read_signature(blob))

    def _session(self, model: bytes, signature: dict) -> OrtProgram:
        ort = self._ort
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: the verdict carries what matters
        # one thread, no spinning: tapml runs many sessions beside other work, and ORT's default
        # thread pool spins on every core between runs
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        try:
            session = ort.InferenceSession(model, options, providers=[self.provider])
        except Exception as e:  # noqa: BLE001 - ORT's session errors are the runtime's verdict
            raise BackendRefused(_session_error(e, model, self.provider)) from None
        elsewhere = [f"{node.op_type} {node.name!r}" for part in session.get_provider_graph_assignment_info()
                     if part.ep_name != self.provider for node in part.get_nodes()]
        if self.provider not in session.get_providers() or elsewhere:
            raise BackendRefused(f"onnxruntime did not put the program on {self.provider} as asked (it falls back "
                                 f"silently): {', '.join(elsewhere[:5]) or 'every node'}"
                                 f"{f' and {len(elsewhere) - 5} more' if len(elsewhere) > 5 else ''} "
                                 f"on {', '.join(p for p in session.get_providers() if p != self.provider) or 'another provider'}")
        feeds = feed_names(signature, [i.name for i in session.get_inputs()], len(session.get_outputs()))
        return OrtProgram(session, feeds, signature["outputs"])

    def run(self, compiled: Compiled, inputs: list) -> list:
        program: OrtProgram = compiled.handle
        if len(inputs) != len(program.inputs):
            raise ValueError(f"{len(inputs)} inputs given; the program takes {len(program.inputs)}")
        ort = self._ort
        feeds = {name: ort.OrtValue.from_dlpack(t.contiguous()) for name, t in zip(program.inputs, inputs) if name}
        results = program.session.run_with_ort_values(None, feeds)
        if len(results) != program.outputs:
            raise RuntimeError(f"onnxruntime returned {len(results)} outputs; the program has {program.outputs}")
        # as ONNX Runtime made them: a dtype or shape the route changed is the comparison's finding
        return [torch.from_dlpack(r).clone() for r in results]


def _session_error(error: Exception, model: bytes, provider: str) -> str:
    """ONNX Runtime's refusal of a model, with the dtypes of the node it has no kernel for."""
    import re
    text = str(error).strip()
    found = re.search(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'", text)
    if not found:
        return f"onnxruntime could not load model.onnx: {text}"
    op, version, name = found.groups()
    return (f"onnxruntime's {provider} has no kernel for ONNX {op}({version}) on "
            f"{', '.join(node_types(model, [name]).get(name, ([], []))[0]) or 'these inputs'} (node {name!r})")


__all__ = ["ONNX_DTYPES", "SIGNATURE_KEY", "OrtBackend", "OrtProgram"]
