"""Carving a generation: prefill plus greedy decode steps against a static key/value cache.

A chat LLM runs a loop: one *prefill* call over the prompt, then one *decode* call per new
token, each reading and updating the key/value cache. :func:`carve_generation` exports both
programs through transformers' own ExecuTorch recipe
(``transformers.integrations.executorch.TorchExportableModuleForDecoderOnlyLM``, a
``StaticCache`` registered as buffers), decomposes each to core ATen, and runs the loop on the
reference with the carving tracer, so that every op call of every step is a case. The cache
is the programs' mutated buffers: a graph's ``state`` (:class:`tapml.graph.Graph`) says which
output each buffer input takes after a step, and the loop feeds it back.

The store keeps its usual keys for the prefill program (existing tools read a generation store
as the store of its prefill step) and adds a ``generation`` object with the decode program,
each step's inputs, last-position logits and greedy token (see :mod:`tapml.carving.store`).
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Callable

from tapml.errors import TapmlError

#: The programs' per-step inputs, in the order transformers' recipe exports them.
STEP_INPUTS = ("input_ids", "cache_position")
#: The programs of a generation, in the order they run.
KINDS = ("prefill", "decode")


def carve_generation(spec: str, out: str | Path, *, tokens: int, prompt_len: int = 8, seed: int = 0,
                     hf_config: dict | None = None, device: str = "cpu",
                     on_step: Callable[[dict], None] | None = None, dtype: str = "float32",
                     prompt_ids: list[int] | None = None, quantize: str | None = None,
                     quantized_ops: str = "whole", cache: int | None = None) -> dict:
    """Carve a greedy generation of ``tokens`` new tokens after a ``prompt_len``-token prompt.

    ``spec`` must be a causal LM (``zoo:tiny-llama``, ``zoo:tiny-gpt2``, ``hf:llama``,
    ``hf:gpt2``, ``hf:gpt_neox``, ``hf:qwen2``...; see :func:`tapml.frontends.models.load_causal_lm`). The
    prompt is ``prompt_ids`` when given (``prompt_len`` is then their number; each must be below the
    model's vocabulary size), else ``prompt_len`` random token ids drawn from ``seed``. Step 0 is the prefill
    (``input_ids [1, prompt_len]``, ``cache_position = arange(prompt_len)``); steps 1..tokens
    are decode steps, each feeding the previous step's argmax token at the next position, so
    the cache holds ``prompt_len + tokens`` positions. Every step's op calls become cases of
    one CarveStore at ``out`` (written into a temporary folder and renamed into place, like
    :func:`tapml.carving.carve`), deduplicated across steps and layers, each tagged with its
    ``graph`` and ``steps``. ``on_step(step)`` is called with each step's record
    (``{"step", "kind", "token", ...}``) as it completes. ``dtype`` (``float32``, ``float16``,
    ``bfloat16``): the model's parameters, its cache and the reference run in it (the
    manifest's ``dtype``). ``quantize``: the packed-weight scheme of its linears and embeddings
    (:mod:`tapml.frontends.quantize`; the manifest's ``quantize``), ``quantized_ops`` whether each
    quantized op is carved whole or as its float chain. ``cache``: positions of the static
    key/value cache (the manifest's ``max_cache_len``), at least ``prompt_len + tokens``, which is
    the default; a larger cache is what a deployment allocates once for its longest context.

    Returns figures: ``export_s``, ``carve_s``, ``bytes``, ``cases``, ``nodes`` (prefill),
    ``decode_nodes``, ``steps``, ``reference_tokens`` (the ``tokens`` generated token ids) and
    ``decode_s_per_step`` (the reference's time per decode step, tracing included).
    Raises TapmlError for bad input (not a causal LM, ``tokens < 1``, a prompt too long...).
    Example: ``carve_generation("zoo:tiny-llama", "stores/gen", tokens=4, prompt_len=5)``.
    """
    from tapml.carving import write_store_atomically
    from tapml.carving.manifest import MAX_GENERATION_TOKENS
    from tapml.frontends.models import load_causal_lm, model_positions

    if device not in ("cpu", "cuda"):
        raise TapmlError(f"--device must be cpu or cuda, not {device!r}")
    if prompt_ids is not None:
        if not prompt_ids or not all(type(i) is int and i >= 0 for i in prompt_ids):
            raise TapmlError("the prompt must be one or more token ids, each 0 or more")
        prompt_len = len(prompt_ids)
    if cache is not None and not prompt_len + tokens <= cache <= 2 * MAX_GENERATION_TOKENS:
        raise TapmlError(f"--cache {cache}: the cache must hold the prompt and every generated token "
                         f"({prompt_len} + {tokens} = {prompt_len + tokens} positions) and at most "
                         f"{2 * MAX_GENERATION_TOKENS}")
    model = load_causal_lm(spec, tokens=tokens, prompt_len=prompt_len, seed=seed, hf_config=hf_config, dtype=dtype,
                           quantize=quantize, quantized_ops=quantized_ops)
    vocab = int(model.config.get_text_config().vocab_size)
    positions = model_positions(model.config.get_text_config())
    if cache is not None and positions is not None and cache > positions:
        raise TapmlError(f"--cache {cache} exceeds {spec}'s {positions} positions; give a smaller --cache"
                         + ("" if spec.startswith("zoo:") else ", or raise max_position_embeddings with --hf-config"))
    if prompt_ids is not None and max(prompt_ids) >= vocab:
        raise TapmlError(f"prompt token id {max(prompt_ids)} is not in {spec}'s vocabulary of {vocab} tokens "
                         f"(ids 0 to {vocab - 1})")
    return write_store_atomically(out, lambda tmp: _carve_generation_into(
        model, spec, tmp, tokens=tokens, prompt_len=prompt_len, seed=seed, hf_config=hf_config, device=device,
        on_step=on_step, dtype=dtype, prompt_ids=prompt_ids, quantize=quantize, quantized_ops=quantized_ops,
        cache=cache))


def export_generation_programs(model, prompt_len: int, max_cache_len: int, spec: str = "the model"):
    """Export ``model`` (a causal LM with a static cache, see
    :func:`tapml.frontends.models.load_causal_lm`) as a prefill program (``input_ids [1, prompt_len]``)
    and a decode program (``input_ids [1, 1]``), both over a ``max_cache_len`` static cache and
    decomposed to core ATen. Returns ``(prefill, decode)`` ExportedPrograms.

    The programs are transformers' own ExecuTorch recipe's. Some architectures derive their
    positions (OPT, XGLM) or their attention mask (BioGPT) from the cache's length, a
    data-dependent scalar (``aten._local_scalar_dense``) that sizes tensors differently at every
    step, or that export refuses outright; such a model, when its ``forward`` takes
    ``position_ids``, is exported again with both passed in as transformers' own ``generate``
    passes them (:func:`_positions_as_inputs`), so they are inputs of the program, not computed
    from data. TapmlError when the model does not export with a static cache, or when a program
    still holds a data-dependent value (naming ``spec``, the program and the node).
    """
    import torch
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from tapml.frontends.capture import export
    from tapml.graph import needs_real_values

    ids = torch.zeros(1, prompt_len, dtype=torch.long)
    examples = [{"input_ids": ids, "cache_position": torch.arange(prompt_len)},
                {"input_ids": ids[:, :1], "cache_position": torch.tensor([prompt_len])}]
    try:
        recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len,
                                                       device=torch.device("cpu"))
    except Exception as e:  # noqa: BLE001 - any failure here is the model's, reported plainly
        raise _not_exportable(spec, e) from None
    routes = [recipe.export]
    if "position_ids" in inspect.signature(model.forward).parameters:
        module = _positions_as_inputs(recipe.model, max_cache_len)
        routes.append(lambda **example: torch.export.export(module, (), example, strict=True))
    failure, data_dependent = None, None
    for route in routes:
        try:
            with torch.no_grad():
                programs = []
                for example in examples:
                    programs.append(export(route(**example), ()))
                    if needs_real_values(programs[-1].graph):
                        break
                else:
                    return tuple(programs)
            data_dependent = data_dependent or programs
        except Exception as e:  # noqa: BLE001 - any failure here is the model's, reported plainly
            failure = failure or e
    if data_dependent is None:
        raise _not_exportable(spec, failure) from None
    _program_graph(spec, data_dependent[-1], KINDS[len(data_dependent) - 1])  # names the node
    raise AssertionError("needs_real_values and graph_from_fx disagree")


def _program_graph(spec: str, program, kind: str):
    """The :class:`tapml.graph.Graph` of the generation's ``kind`` (prefill, decode) program;
    TapmlError naming ``spec``, the program and the node when it cannot be represented (a value
    that depends on the data)."""
    from tapml.graph import graph_from_fx
    try:
        return graph_from_fx(program.graph, program.graph_signature)
    except ValueError as e:
        raise TapmlError(f"{spec}: the exported generation programs cannot be represented (its {kind} "
                         f"program): {e}") from None


def _not_exportable(spec: str, e: Exception) -> TapmlError:
    """Export's failure as bad input: its first line and, where torch's tracer says which line of the
    model's code it was tracing (``real_stack``), that line."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    stack = getattr(e, "real_stack", None) or []
    where = ""
    if stack and getattr(stack[-1], "filename", None):
        frame = stack[-1]
        path = frame.filename.replace("\\", "/").rsplit("site-packages/", 1)[-1]
        where = f" (at {path}:{frame.lineno}: {(frame.line or '').strip()[:160]})"
    return TapmlError(f"{spec} does not export with a static key/value cache "
                      f"(transformers' ExecuTorch recipe): {type(e).__name__}: {first[:300]}{where}")


def _positions_as_inputs(exportable, max_cache_len: int):
    """A module that runs transformers' export module ``exportable`` (the recipe's
    ``TorchExportableModuleWithStaticCache`` or ``...WithHybridCache``: the model and its static
    cache, registered as buffers) as its own ``forward`` does, but hands the model what
    ``generate`` gives an unpadded prompt over a static cache: ``position_ids =
    cache_position[None]`` and an attention mask of ones over the ``max_cache_len`` cache slots
    (slots past the current position are masked by causality), so neither is derived from the
    cache's length."""
    import torch

    class PositionsAsInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.exportable = exportable

        def forward(self, input_ids, cache_position):
            static = hasattr(self.exportable, "static_cache")
            cache = self.exportable.static_cache if static else self.exportable.cache
            for layer in cache.layers:  # as the recipe does: the cache's length is the first position
                layer.cumulative_length.copy_(cache_position[0])
            mask = torch.ones(input_ids.shape[0], max_cache_len, dtype=torch.long, device=input_ids.device)
            out = self.exportable.model(input_ids=input_ids, attention_mask=mask, cache=cache, use_cache=True,
                                        position_ids=cache_position.unsqueeze(0))
            return out.logits if hasattr(out, "logits") else out.last_hidden_state

    return PositionsAsInputs()


def _carve_generation_into(model, spec: str, out: Path, *, tokens: int, prompt_len: int, seed: int,
                           hf_config: dict | None, device: str, on_step: Callable[[dict], None] | None,
                           dtype: str = "float32", prompt_ids: list[int] | None = None,
                           quantize: str | None = None, quantized_ops: str = "whole", cache: int | None = None) -> dict:
    import torch

    from tapml.frontends.capture import program_inputs
    from tapml.carving.store import CarveStoreWriter
    from tapml.carving.tracer import CarvingInterpreter

    if device == "cuda" and not torch.cuda.is_available():
        raise TapmlError("--device cuda: no CUDA device on this machine; use --device cpu")
    t0 = time.perf_counter()
    max_cache_len = cache or prompt_len + tokens
    vocab = int(model.config.get_text_config().vocab_size)
    prompt = torch.tensor([prompt_ids]) if prompt_ids is not None else \
        torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    programs = export_generation_programs(model, prompt_len, max_cache_len, spec)
    if device == "cuda":
        from torch.export.passes import move_to_device_pass
        programs = tuple(move_to_device_pass(ep, "cuda") for ep in programs)
    graphs = [_program_graph(spec, ep, kind) for ep, kind in zip(programs, KINDS)]
    prefill_ep, decode_ep = programs
    prefill, decode = graphs
    logits_refs = [_logits_ref(g) for g in graphs]
    if set(prefill.state) != set(decode.state) or not prefill.state:
        raise RuntimeError(f"the prefill and decode programs of {spec} hold different caches "
                           f"({sorted(prefill.state)[:4]} vs {sorted(decode.state)[:4]})")
    t1 = time.perf_counter()

    writer = CarveStoreWriter(out)
    first_inputs = {"input_ids": prompt, "cache_position": torch.arange(prompt_len)}
    prefill_stored, stored_by_target = {}, {}
    values = {}  # prefill program inputs by graph input name
    for (name, kind, t), spec_ in zip(program_inputs(prefill_ep, tuple(first_inputs.values())),
                                      prefill_ep.graph_signature.input_specs):
        t = first_inputs[name] if kind == "input" else t
        tensor_name = writer.put(f"in.{name}", t)
        prefill_stored[name] = {"kind": kind, "tensor": tensor_name}
        values[name] = t.to(device)
        if spec_.target is not None:
            stored_by_target[spec_.target] = (tensor_name, t)

    recorder = CarvingInterpreter(prefill_ep.graph_module, prefill, writer, graph_kind="prefill")
    steps, decode_s = [], 0.0
    outputs = _run_step(recorder, prefill, values)
    model_outputs = {ref: writer.put(f"out.{i}", t) for i, (ref, t) in enumerate(outputs.items())}
    state = {name: outputs[ref] for name, ref in prefill.state.items()}
    steps.append(_step_record(writer, 0, "prefill", {k: prefill_stored[k]["tensor"] for k in first_inputs},
                              outputs[logits_refs[0]]))
    if on_step:
        on_step(steps[-1])

    # The decode program's parameters and initial buffers are the prefill's: stored once.
    decode_stored, decode_values = {}, {}
    step_names = {k: f"step1.{k}" for k in STEP_INPUTS}
    for (name, kind, t), spec_ in zip(program_inputs(decode_ep, (prompt[:, :1], torch.tensor([prompt_len]))),
                                      decode_ep.graph_signature.input_specs):
        if kind == "input":
            decode_stored[name] = {"kind": kind, "tensor": step_names[name]}
            continue
        shared = stored_by_target.get(spec_.target)
        if shared is not None and _same_tensor(shared[1], t):
            decode_stored[name] = {"kind": kind, "tensor": shared[0]}
        else:
            decode_stored[name] = {"kind": kind, "tensor": writer.put(f"decode.in.{name}", t)}
        decode_values[name] = t.to(device)
    recorder = CarvingInterpreter(decode_ep.graph_module, decode, writer, shares=recorder, graph_kind="decode")
    for k in range(1, tokens + 1):
        step_inputs = {"input_ids": torch.tensor([[steps[-1]["token"]]]),
                       "cache_position": torch.tensor([prompt_len + k - 1])}
        stored = {name: writer.put(f"step{k}.{name}", t) for name, t in step_inputs.items()}
        recorder.step = k
        started = time.perf_counter()
        outputs = _run_step(recorder, decode, {**decode_values, **state,
                                               **{n: t.to(device) for n, t in step_inputs.items()}})
        decode_s += time.perf_counter() - started
        state = {name: outputs[ref] for name, ref in decode.state.items()}
        steps.append(_step_record(writer, k, "decode", stored, outputs[logits_refs[1]]))
        if on_step:
            on_step(steps[-1])

    prefill_json = prefill.to_json()
    reference_tokens = [s["token"] for s in steps[:tokens]]
    writer.close({
        "model": spec, "hf_config": hf_config or {}, "torch_version": torch.__version__,
        "reference_device": device, "seed": seed, "dtype": dtype, **({"quantize": quantize} if quantize else {}),
        **({"quantized_ops": quantized_ops} if quantize and quantized_ops != "whole" else {}),
        "graph_inputs": prefill_json["inputs"], "nodes": prefill_json["nodes"],
        "graph_outputs": prefill_json["outputs"], "program_inputs": prefill_stored, "model_outputs": model_outputs,
        "cases": recorder.cases,
        "generation": {"prompt_len": prompt_len, "tokens": tokens, "max_cache_len": max_cache_len,
                       "decode": {**decode.to_json(), "program_inputs": decode_stored},
                       "prefill_state": dict(prefill.state), "steps": steps, "reference_tokens": reference_tokens},
    })
    t2 = time.perf_counter()
    return {"export_s": t1 - t0, "carve_s": t2 - t1, "bytes": writer.bytes_written, "cases": len(recorder.cases),
            "nodes": len(prefill.nodes), "decode_nodes": len(decode.nodes), "steps": len(steps),
            "reference_tokens": reference_tokens, "decode_s_per_step": decode_s / tokens}


def _logits_ref(graph) -> str:
    """The one graph output that is no state: the logits."""
    taken = set(graph.state.values())
    rest = [r for r in graph.outputs if r not in taken]
    if len(rest) != 1 or len(graph.meta[rest[0]].shape) != 3:
        raise RuntimeError(f"expected one logits output [batch, seq, vocab] besides the cache, found {rest[:4]}")
    return rest[0]


def _run_step(recorder, graph, values: dict) -> dict:
    """Run one program through the carving tracer; its outputs by ref."""
    import torch
    with torch.no_grad():
        result = recorder.run(*[values[name] for name, _ in graph.inputs], enable_io_processing=False)
    leaves = [x for x in torch.utils._pytree.tree_leaves(result) if isinstance(x, torch.Tensor)]
    return dict(zip(graph.outputs, leaves))


def _step_record(writer, step: int, kind: str, inputs: dict[str, str], logits) -> dict:
    last = logits[0, -1]
    return {"step": step, "kind": kind, "inputs": inputs, "logits": writer.put(f"step{step}.logits", last),
            "token": int(last.argmax())}


def _same_tensor(a, b) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool((a == b).all()))


__all__ = ["carve_generation", "export_generation_programs", "STEP_INPUTS"]
