"""Capture: torch.export (non-strict), then ``run_decompositions()`` to core ATen."""

from __future__ import annotations

import contextlib
import logging

import torch

from tapml.errors import TapmlError


def export(model, example_inputs: tuple) -> "torch.export.ExportedProgram":
    """Export ``model`` (or re-decompose an ExportedProgram) to core ATen.

    Raises TapmlError naming the cause when the model does not export.
    """
    if isinstance(model, torch.export.ExportedProgram):
        ep = model
    else:
        try:
            args, kwargs = split_inputs(example_inputs)
            with torch.no_grad(), _quiet_fake_tensors():
                ep = torch.export.export(model, args, kwargs=kwargs, strict=False)
        except Exception as e:  # noqa: BLE001 - any export failure is the model's, reported plainly
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise TapmlError(f"the model does not export with torch.export: {type(e).__name__}: {first}") from None
    try:
        return ep.run_decompositions(decomposition_table())
    except Exception as e:  # noqa: BLE001
        raise TapmlError(f"decomposing the exported program to core ATen failed: {type(e).__name__}: {e}") from None


def decomposition_table() -> dict:
    """torch's default core-ATen decompositions, with ``group_norm`` made contiguous first.

    Eager ``group_norm`` copies its input into the memory format the real strides suggest before
    ``native_group_norm``; traced on fake tensors, a channels-last input whose real strides differ
    (diffusers' UNet2DModel and AutoencoderKL after an attention block) goes in as it is, and the
    decomposed program fails with ``Expected X.is_contiguous(memory_format)``.
    """
    table = torch.export.default_decompositions()
    table[torch.ops.aten.group_norm.default] = _group_norm_contiguous
    return table


def _group_norm_contiguous(input, num_groups, weight=None, bias=None, eps=1e-05, cudnn_enabled=True):
    x = input.contiguous()
    n, c = x.shape[0], x.shape[1]
    hw = 1
    for size in x.shape[2:]:
        hw = hw * size
    return torch.ops.aten.native_group_norm.default(x, weight, bias, n, c, hw, num_groups, eps)[0]


@contextlib.contextmanager
def _quiet_fake_tensors():
    """torch logs the traceback of an op that fails on fake tensors before raising the error (a
    float16 op torch has no kernel for, say); the error becomes one line, so its log is muted."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def split_inputs(example_inputs: tuple) -> tuple[tuple, dict]:
    """Example inputs are positional; a trailing dict holds keyword inputs."""
    example_inputs = tuple(example_inputs)
    if example_inputs and isinstance(example_inputs[-1], dict):
        return example_inputs[:-1], dict(example_inputs[-1])
    return example_inputs, {}


def program_inputs(ep, example_inputs: tuple) -> list[tuple[str, str, torch.Tensor]]:
    """``(placeholder, kind, tensor)`` for every tensor input of the exported graph, in order.

    ``kind`` is ``param``, ``buffer``, ``constant`` or ``input``. Non-tensor model inputs
    (``return_dict=False``, an int) are constants of the graph and effect tokens no inputs at
    all (see :func:`tapml.graph.graph_from_fx`), so neither is listed.
    """
    return [(name, kind, value) for name, kind, value in _placeholders(ep, example_inputs)
            if kind not in ("literal", "token")]


def placeholder_values(ep, example_inputs: tuple, device: str = "cpu") -> list:
    """The value of every placeholder of ``ep.graph``, in order, to run its graph module: the
    tensors of :func:`program_inputs` on ``device``, non-tensor inputs as the example gave them,
    an empty tensor for each effect token."""
    return [value.to(device) if isinstance(value, torch.Tensor) else value
            for _, _, value in _placeholders(ep, example_inputs)]


def _placeholders(ep, example_inputs: tuple) -> list[tuple[str, str, object]]:
    from torch.export.graph_signature import InputKind, TensorArgument
    user = [x for x in torch.utils._pytree.tree_leaves(split_inputs(example_inputs)) if isinstance(x, torch.Tensor)]
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    state = ep.state_dict
    out = []
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT and not isinstance(spec.arg, TensorArgument):
            out.append((name, "literal", getattr(spec.arg, "value", vals.get(name))))
        elif spec.kind == InputKind.USER_INPUT:
            if not user:
                raise TapmlError("the exported program takes more inputs than were given")
            out.append((name, "input", user.pop(0)))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            t = state[spec.target] if spec.target in state else ep.constants[spec.target]
            out.append((name, "param" if spec.kind == InputKind.PARAMETER else "buffer", t))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            out.append((name, "constant", ep.constants[spec.target]))
        elif spec.kind == InputKind.TOKEN:
            out.append((name, "token", torch.empty(0)))
        else:
            raise TapmlError(f"unsupported exported input kind {spec.kind} ({name})")
    return out
