"""The ONNX route, shared by every backend that runs ONNX (``ort``, ``ort-web:*``, ``tinygrad:*``).

An ExportedProgram -> torch's ONNX exporter (``torch.onnx.export(..., dynamo=True)``'s translation,
onnxscript's torchlib) -> ONNX bytes carrying the program's signature in their metadata
(:data:`SIGNATURE_KEY`), so that a cached model (the compile cache's blob, a repro's ``model.onnx``)
is fed as the fresh one was. :func:`onnx_model` makes them, :func:`read_signature` reads them back.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import warnings

import torch

from tapml.platforms.backend import BackendRefused
from tapml.schema import ClosedSchema, Count, Str, validate

# ONNX Runtime's official wheels (1.2x on) start Microsoft's 1DS telemetry when the library loads: a
# database under ~/.cache/Microsoft, a session file in $TMPDIR, uploads when online. This variable,
# set before the first import, turns all of it off for the process and its children; a user who
# sets it otherwise keeps their choice.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

#: torch dtype -> the ONNX element type that carries it (what the exporter and ONNX Runtime take).
ONNX_DTYPES = {
    torch.float32: "FLOAT", torch.float16: "FLOAT16", torch.bfloat16: "BFLOAT16", torch.float64: "DOUBLE",
    torch.int64: "INT64", torch.int32: "INT32", torch.int16: "INT16", torch.int8: "INT8", torch.uint8: "UINT8",
    torch.bool: "BOOL",
}


@functools.cache
def exporter() -> tuple:
    """``(export, opset)``: torch's ONNX exporter bound to one registry of ONNX functions.

    ``torch.onnx.export(dynamo=True)`` builds that registry on every call (most of its time for one
    op); torch's ``_core.export`` takes a registry, so it is built once per process. When a torch
    release moves that module, the public exporter is used (slower, same ONNX)."""
    from torch.onnx import _constants

    opset = _constants.ONNX_DEFAULT_OPSET
    try:
        from torch.onnx._internal.exporter import _core, _registration
    except ImportError:
        return (lambda program: torch.onnx.export(program, dynamo=True, verbose=False, opset_version=opset)), opset
    with quiet():
        registry = _registration.ONNXRegistry.from_torchlib(opset_version=opset)
    return (lambda program: _core.export(program, registry=registry, verbose=False, opset_version=opset)), opset


@contextlib.contextmanager
def quiet():
    # the exporter logs a warning per torchvision op it skips, its optimizer one per initializer it
    # keeps, and torch warns per export: none of it is news to a tapml user
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnx_ir", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def root_cause(error: BaseException) -> BaseException:
    # the exporter wraps the real reason (no ONNX function for an op, a NotImplementedError in
    # torchlib) in a ConversionError whose own text is a page of advice
    seen = set()
    while error.__cause__ is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__
    return error


#: The model.onnx metadata key holding the program's signature: ``{"inputs": [names], "outputs": N}``,
#: so that :meth:`OrtBackend.load` feeds a cached model as :meth:`OrtBackend.compile` would.
SIGNATURE_KEY = "tapml.program"


def signature(program) -> dict:
    """The ExportedProgram's input names and output count; BackendRefused for a non-tensor output."""
    node = next(n for n in program.graph.nodes if n.op == "output")
    for i, value in enumerate(node.args[0]):
        meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
        if not isinstance(meta, torch.Tensor):
            raise BackendRefused(f"output {i} of the program is {type(meta).__name__}, not a tensor")
    return {"inputs": [n.name for n in program.graph.nodes if n.op == "placeholder"], "outputs": len(node.args[0])}


class SignatureJSON(ClosedSchema):
    """The signature :meth:`OrtBackend.compile` writes into the ONNX model's metadata: the
    ExportedProgram's input names and its number of outputs."""

    inputs: list[Str]
    outputs: Count


def read_signature_of(model) -> dict:
    text = next((p.value for p in model.metadata_props if p.key == SIGNATURE_KEY), None)
    try:
        return validate(SignatureJSON, json.loads(text) if text is not None else None, SIGNATURE_KEY).model_dump()
    except ValueError as e:  # not JSON, or not the signature's schema
        raise BackendRefused(f"model.onnx has no valid {SIGNATURE_KEY} metadata ({e}): it was not made by "
                             "OrtBackend.compile") from None


def refuse_dtypes(program, carried=ONNX_DTYPES, carrier: str = "the ONNX route") -> str | None:
    """Why ``carrier`` cannot carry ``program`` (a value of a dtype outside ``carried``: by default, one ONNX
    has no type for), else None."""
    for node in program.graph.nodes:
        meta = node.meta.get("val")
        for value in meta if isinstance(meta, (list, tuple)) else (meta,):
            if isinstance(value, torch.Tensor) and value.dtype not in carried:
                return f"{node.name} is {str(value.dtype).removeprefix('torch.')}, which {carrier} does not carry"
    return None


def onnx_model(program) -> tuple[bytes, dict]:
    """``(model.onnx bytes, signature)`` of an ExportedProgram; BackendRefused (with the exporter's
    own reason) when the exporter cannot convert it or an output is not a tensor."""
    program_signature = signature(program)
    export, _ = exporter()
    try:
        with quiet():
            proto = export(program).model_proto
    except Exception as e:  # noqa: BLE001 - any exporter failure is the route's verdict
        root = root_cause(e)
        raise BackendRefused(f"the ONNX exporter could not convert the program: {type(root).__name__}: {root}") from None
    proto.metadata_props.add(key=SIGNATURE_KEY, value=json.dumps(program_signature))
    return proto.SerializeToString(), program_signature


def read_signature(blob: bytes) -> dict:
    """The signature :func:`onnx_model` wrote into ONNX bytes; BackendRefused when they do not parse
    or carry none (a damaged or foreign blob is refused, never run)."""
    import onnx
    try:
        model = onnx.load_model_from_string(blob)
    except Exception as e:  # noqa: BLE001 - a damaged blob is refused, never run
        raise BackendRefused(f"model.onnx does not parse: {e}") from None
    return read_signature_of(model)


def onnx_feeds(onnx_inputs: list[str], names: list[str]) -> list[str | None]:
    """The ONNX input fed from each program input (``names``): in order when the model takes them all
    (the exporter may rename an input that is also an output), else by name, None for one the
    exporter dropped as unused. ValueError when the model takes an input the program lacks.
    Self-contained (no tapml import in its body): repro runners carry its source."""
    if len(onnx_inputs) == len(names):
        return list(onnx_inputs)
    unknown = sorted(set(onnx_inputs) - set(names))
    if unknown:
        raise ValueError(f"model.onnx takes inputs the program does not have: {', '.join(unknown)}")
    return [n if n in onnx_inputs else None for n in names]


def feed_names(signature: dict, session_inputs: list[str], session_outputs: int) -> list[str | None]:
    """:func:`onnx_feeds` of a session for the program of ``signature``; BackendRefused when the ONNX model
    takes inputs the program does not have or has another number of outputs."""
    try:
        feeds = onnx_feeds(list(session_inputs), signature["inputs"])
    except ValueError as e:
        raise BackendRefused(str(e)) from None
    if session_outputs != signature["outputs"]:
        raise BackendRefused(f"model.onnx has {session_outputs} outputs; the program has {signature['outputs']}")
    return feeds


def node_types(model: bytes, names) -> dict[str, tuple[list[str], list[str]]]:
    """``{node name: (input dtypes, output dtypes)}`` of the named nodes of ONNX ``model`` (lower-case ONNX
    type names, each once, as shape inference finds them)."""
    import onnx
    graph = onnx.shape_inference.infer_shapes(onnx.load_model_from_string(model)).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    types.update({t.name: t.data_type for t in graph.initializer})
    wanted = set(names)

    def named(values):
        return list(dict.fromkeys(onnx.TensorProto.DataType.Name(types[v]).lower() for v in values if v in types))
    return {n.name: (named(n.input), named(n.output)) for n in graph.node if n.name in wanted}


def opset() -> int:
    """The ONNX opset the exporter writes."""
    return exporter()[1]


__all__ = ["ONNX_DTYPES", "SIGNATURE_KEY", "feed_names", "node_types", "onnx_feeds", "onnx_model", "opset", "read_signature", "refuse_dtypes"]
