"""Checking a generation on a target: prefill, then decode step by step against the key/value cache.

A generation store (``tapml carve MODEL --generate N``, :mod:`tapml.carving.generation`) holds
the prefill and decode graphs with their cache as ``state``, every step's inputs, and the
reference's last-position logits and greedy token per step. :func:`generate` runs the same
steps on a target through :class:`~tapml.driving.hybrid.HybridRunner`'s step API: every node the target
supports is placed on it, the rest falls back to the reference; weights are uploaded once and
the cache stays where its producer runs, so only token ids and positions cross per step.

- **teacher-forced** (default): every step gets the reference's tokens; each step's logits are
  compared with the reference's (:mod:`tapml.judging.compare` tolerances) and the argmax tokens too.
  A different token where the reference's own top-2 logit gap is within the tolerance is a
  ``near-tie``: reported, not a failure.
- **free** (``free=True``): the target feeds its own tokens; the reference follows the same
  tokens in lockstep so that every step's logits are still comparable, and the first token
  where the target leaves the reference's own generation is reported.
- **low precision** (a store carved with ``--dtype float16|bfloat16``): each step's logits are
  judged against the model in float32 (the float32 twin of the graphs, :func:`tapml.dtypes.as_float32`,
  run with its own float32 cache from the upcast parameters, fed the same tokens), with the
  low dtype's tolerances; the reference token of a step is the twin's argmax. With
  ``keep_float32`` (node names, module paths, op names) those nodes of the prefill and decode
  graphs compute in float32 on the target (:func:`tapml.dtypes.keep_float32`, casts placed like
  their neighbours) while the rest stays in the low dtype; the document records the lists.

On the first failing step the migration machinery (:class:`tapml.driving.migrate.Migration`: op stage
on that graph's cases, then regions with bisection) runs on that step's graph with the
reference's real inputs at that step, and names the culprits (op, node, module, kind, step).

Shapes are static: one program per region of the prefill graph (per prompt length) and one
per region of the decode graph, reused by every decode step, so ``programs_compiled`` does not
grow with the number of tokens.

Example::

    store = CarveStore("stores/llama-gen")
    with open_target("wgpu:vulkan") as platform:
        doc = generate(store, platform, "wgpu:vulkan")
    doc["summary"]  # {'steps': 9, 'pass': 9, 'mismatch': 0, 'near_tie': 0, 'error': 0, 'first_failure': None}
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

from tapml.judging.compare import LOGITS_THRESHOLDS, Comparison, Tolerances, anchored_rule, compare_tensor, kl_rows
from tapml.errors import DeviceLost, PlatformError, TapmlError
from tapml.graph import Graph, dtype_name, step as reference_step
from tapml.driving.hybrid import REFERENCE, TARGET, HybridRunner
from tapml.driving.regions import is_quantized
from tapml.judging.verdict import outcome_verdict, stamp

KINDS = ("prefill", "decode")
STEP_STATUSES = ("pass", "mismatch", "near-tie", "error")
COMPILED_PER_SHAPE = ("static shapes, compiled per shape: one program per region of the prefill graph (for this "
                      "prompt length) and one per region of the decode graph, reused by every decode step")
NO_TOKENIZER = "no tokenizer: zoo: and hf: models have random weights and no vocabulary; token ids are shown"


def check_generation_store(store, tokens: int | None = None, prompt_len: int | None = None) -> int:
    """The number of decode steps to check in ``store``: ``tokens`` (at most the store's) or all
    of them. TapmlError (bad input) when the store holds no generation, when ``tokens`` is
    below 1 or beyond what the store holds, or when ``prompt_len`` is not the store's."""
    if not store.is_generation:
        raise TapmlError(f"store {store.path} holds no generation (it was carved from one forward); carve one "
                         f"with `tapml carve {store.model} --generate N -o DIR`, or pass the MODEL to "
                         "`tapml generate`")
    gen = store.manifest["generation"]
    if prompt_len is not None and prompt_len != gen["prompt_len"]:
        raise TapmlError(f"--prompt-len {prompt_len}: store {store.path} was carved with a {gen['prompt_len']}-token "
                         "prompt; leave --prompt-len out or carve again")
    if tokens is None:
        return gen["tokens"]
    if type(tokens) is not int or tokens < 1:
        raise TapmlError(f"--tokens {tokens}: give the number of tokens to decode, 1 or more")
    if tokens > gen["tokens"]:
        raise TapmlError(f"--tokens {tokens}: store {store.path} holds {gen['tokens']} decode steps; ask for at most "
                         f"{gen['tokens']}, or carve a longer generation")
    return tokens


def shared_program_inputs(store) -> dict[str, dict]:
    """``{"prefill": inputs, "decode": inputs}`` by graph input name, where a tensor the two
    graphs share in the store is one tensor object (a runtime that keeps uploaded tensors by
    identity then uploads the weights once for both graphs)."""
    loaded: dict[str, object] = {}
    entries = {"prefill": store.manifest["program_inputs"],
               "decode": store.manifest["generation"]["decode"]["program_inputs"]}
    out = {}
    for kind, by_name in entries.items():
        out[kind] = {}
        for name, info in by_name.items():
            if info["tensor"] not in loaded:
                loaded[info["tensor"]] = store.tensor(info["tensor"])
            out[kind][name] = loaded[info["tensor"]]
    return out


def logits_ref(graph: Graph) -> str:
    """The one output of a step graph that is no state: the logits ``[batch, seq, vocab]``."""
    taken = set(graph.state.values())
    return next(r for r in graph.outputs if r not in taken)


def target_placement(graph: Graph, platform) -> tuple[dict[str, str], list[str]]:
    """Every node ``platform`` supports on the target, the rest on the reference; returns the
    placement and the names of the nodes that fell back."""
    placement, fell_back = {}, []
    for node in graph.nodes:
        if platform.supports(node) is None:
            placement[node.name] = TARGET
        else:
            placement[node.name] = REFERENCE
            fell_back.append(node.name)
    return placement, fell_back


def judge_step(logits, expected, tolerances: Tolerances, reference_token: int,
               dtype: str | None = None, anchor=None) -> tuple[str, Comparison, int]:
    """``(status, comparison, target token)`` of one step's last-position logits against the
    reference's: ``mismatch`` when the logits are out of tolerance, ``near-tie`` when they are
    within it but the argmax differs because the reference's own top-2 gap is within the
    tolerance, else ``pass`` (a different argmax with a wider gap is a ``mismatch``).
    ``dtype``: the low dtype of a float16/bfloat16 generation judged against float32 logits:
    ``logits`` are upcast to ``expected``'s dtype and that low dtype's tolerances apply.
    ``anchor``: the float64 logits of a float32 step, which a logit the tolerance misses may
    be judged against instead (:func:`tapml.judging.compare.anchored_rule`: within 4x the reference's
    own error plus 1e-6), so a target more accurate than the reference never fails."""
    logits = logits.detach().cpu().reshape(-1)
    if dtype is not None and logits.is_floating_point():
        logits = logits.to(expected.dtype)
    rtol, atol = tolerances.against_float32(None, dtype, expected) if dtype else \
        tolerances.get(None, dtype_name(expected.dtype))
    rules = [anchored_rule(expected, anchor.reshape(-1))] if anchor is not None and logits.is_floating_point() else []
    comparison = compare_tensor(logits, expected, rtol, atol, rules=rules)
    token = int(logits.argmax()) if logits.numel() else -1
    if not comparison.passed:
        return "mismatch", comparison, token
    if token == reference_token:
        return "pass", comparison, token
    top = expected.double().topk(2).values
    gap = float(top[0] - top[1])
    if gap <= 2 * (atol + rtol * float(top[0].abs())):  # each logit may move by its tolerance
        comparison.message = (f"argmax {token} instead of {reference_token}: the reference's top-2 gap {gap:.3g} "
                              "is within the tolerance")
        return "near-tie", comparison, token
    comparison.message = f"argmax {token} instead of {reference_token} (the reference's top-2 gap is {gap:.3g})"
    return "mismatch", comparison, token


class StepStore:
    """One step of a generation seen as a plain store, for the migration machinery: its graph
    (prefill or decode, the cache as ordinary inputs and outputs), that graph's cases, the
    reference's real inputs at the step (``program_inputs``) and outputs (``model_outputs``).
    Everything else (tensors, cases' graphs) comes from the generation store."""

    def __init__(self, store, kind: str, inputs: dict, outputs: dict):
        full = store.step_graph(kind)
        self._store = store
        self.graph = Graph(inputs=full.inputs, nodes=full.nodes, outputs=full.outputs, meta=full.meta)
        self.cases = [c for c in store.cases if c.get("graph", "prefill") == kind]
        self._inputs, self._outputs = inputs, outputs

    def program_inputs(self) -> dict:
        return dict(self._inputs)

    def model_outputs(self) -> dict:
        return dict(self._outputs)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


class _ReferenceStepper:
    """The reference's own decoding of the stored graphs, eagerly with torch, op by op."""

    def __init__(self, store, graphs: dict[str, Graph], params: dict[str, dict]):
        self.graphs, self.params = graphs, params
        self.state = {name: params["prefill"][name] for name in graphs["prefill"].state}
        self.decode_s: list[float] = []  # seconds of each decode step

    def step(self, kind: str, step_inputs: dict) -> tuple[dict, dict, dict]:
        """Run one step; returns (its inputs with the cache before it, outputs by ref, new cache)."""
        import torch
        graph = self.graphs[kind]
        inputs = {**self.params[kind], **step_inputs}
        before = dict(self.state)
        start = time.perf_counter()
        with torch.no_grad():
            outputs, self.state = reference_step(graph, {k: v for k, v in inputs.items() if k not in graph.state},
                                                 self.state)
        if kind == "decode":
            self.decode_s.append(time.perf_counter() - start)
        return {**inputs, **before}, outputs, self.state


def generate(store, platform, target: str, *, tokens: int | None = None, free: bool = False,
             tolerances: Tolerances | None = None, localize: bool = True, inject: list[str] | None = None,
             on_step: Callable[[dict], None] | None = None,
             on_event: Callable[[str, dict], None] | None = None, keep_float32: Iterable[str] = ()) -> dict:
    """Run the generation of ``store`` on ``platform`` (opened for the TARGET spec ``target``)
    and judge every step against the reference. Returns the JSON document of ``tapml generate``:
    ``{"target", "model", "device", "mode", "prompt_len", "tokens", "steps": [{"step", "kind",
    "reference_token", "target_token", "max_abs_err", "status", "message"}], "summary": {"steps",
    "pass", "mismatch", "near_tie", "error", "first_failure"}, "culprits": [{"op", "node",
    "module", "kind", "step", "max_abs_err"}], "programs_compiled", "upload_bytes_per_decode_step",
    "tokens_per_s": {"target", "reference"}, ...}``.

    ``tokens``: how many of the store's decode steps to run (default all: ``tokens + 1`` steps
    with the prefill). ``free``: the target feeds its own tokens (``first_divergence`` says where
    they leave the reference's). ``localize``: on the first failing step, run the migration
    machinery on that step's graph with the reference's real inputs and name the culprits.
    ``on_step(row)`` sees each step's row as it is judged; ``on_event`` is the migration's.
    ``keep_float32``: what runs in float32 on the target in a float16/bfloat16 store (``keep_float32``
    of the document: ``{"prefill": nodes, "decode": nodes}``).
    Raises TapmlError when the store holds no generation, or a keep_float32 item names nothing
    (or the store is float32); DeviceLost when the device goes away.
    """
    from tapml.dtypes import keep_float32 as keep_float32_graph
    from tapml.driving.precision import resolve_keep_float32
    from tapml.driving.replay import device_info
    tokens = check_generation_store(store, tokens)
    tolerances = tolerances or Tolerances()
    graphs = {k: store.step_graph(k) for k in KINDS}
    kept = resolve_keep_float32(graphs, keep_float32)
    mixed = {k: keep_float32_graph(graphs[k], kept[k]) for k in KINDS}
    params = shared_program_inputs(store)
    refs = {k: logits_ref(graphs[k]) for k in KINDS}
    placements, fell_back = {}, {}
    for k in KINDS:
        placements[k], fell_back[k] = target_placement(mixed[k], platform)
        own = {n.name for n in graphs[k].nodes}  # casts are bookkeeping: the counts are the model's nodes
        fell_back[k] = [n for n in fell_back[k] if n in own]
    runners = {k: HybridRunner(mixed[k], platform) for k in KINDS}
    reference = _ReferenceStepper(store, graphs, params)
    low, twin = _float32_twin(store, graphs, params)
    stored_steps = store.steps[:tokens + 1]
    gen = store.manifest["generation"]

    rows: list[dict] = []
    state: dict = {name: params["prefill"][name] for name in graphs["prefill"].state}
    target_tokens: list[int] = []
    uploads, target_decode_s = [], []
    first_failure, failing = None, None
    first_divergence = None
    for s in stored_steps:
        k, kind = s["step"], s["kind"]
        graph = mixed[kind]
        if free and k > 0:
            step_inputs = {"input_ids": _token_tensor(target_tokens[-1]), **_other_step_inputs(store, k)}
        else:
            step_inputs = store.step_inputs(k)
        ref_inputs, ref_outputs, _ = reference.step(kind, step_inputs)
        expected = store.step_logits(k) if not free or first_divergence is None else \
            ref_outputs[refs[kind]][0, -1].detach().cpu()
        reference_token = s["token"] if not free or first_divergence is None else int(expected.argmax())
        if twin is not None:  # low precision: judged against the model in float32, fed the same tokens
            expected = twin.step(kind, step_inputs)[1][refs[kind]][0, -1].detach().cpu()
            reference_token = int(expected.argmax())
        before = platform.upload_bytes
        start = time.perf_counter()
        try:
            outputs, state = runners[kind].step({n: v for n, v in params[kind].items() if n not in graph.state}
                                                | step_inputs, state, placements[kind])
            logits = outputs[refs[kind]][0, -1]
        except DeviceLost:
            raise
        except Exception as e:  # noqa: BLE001 - a failing step is a verdict, not a crash
            verdict = outcome_verdict(e)
            rows.append(_row(k, kind, reference_token, None, None, "error", verdict.message))
        else:
            if kind == "decode":
                target_decode_s.append(time.perf_counter() - start)
                uploads.append(platform.upload_bytes - before)
            status, comparison, token = judge_step(logits, expected, tolerances, reference_token, low)
            if status == "mismatch" and low is None and not comparison.passed:  # float32: against float64 too
                from tapml.driving.regions import float64_anchor_values
                anchor = float64_anchor_values(graphs[kind], ref_inputs, [refs[kind]])
                if anchor is not None:
                    status, comparison, token = judge_step(logits, expected, tolerances, reference_token, low,
                                                           anchor[refs[kind]][0, -1].detach().cpu())
            target_tokens.append(token)
            rows.append(_row(k, kind, reference_token, token, comparison.max_abs_err, status, comparison.message))
            rows[-1]["kl"] = step_kl(logits, expected)
            if free and first_divergence is None and token != s["token"]:
                first_divergence = k
        if on_step:
            on_step(rows[-1])
        if rows[-1]["status"] in ("mismatch", "error") and first_failure is None:
            first_failure = k
            failing = (kind, ref_inputs, ref_outputs)
        if rows[-1]["status"] == "error":
            break  # the target's cache is unknown after a step that did not run

    culprits, localization = [], None
    if failing is not None and localize:
        culprits, localization = _localize(store, platform, target, first_failure, *failing, tolerances=tolerances,
                                           inject=inject, on_event=on_event, keep_float32=kept[failing[0]])
    counts = {status: sum(r["status"] == status for r in rows) for status in STEP_STATUSES}
    return stamp("generation", {
        "target": target, "model": store.model, "device": device_info(platform),
        "mode": "free" if free else "teacher-forced", "prompt_len": gen["prompt_len"], "tokens": tokens,
        "dtype": store.dtype, "judged_against": "float32" if low else store.dtype,
        "keep_float32": kept, "casts": {k: len(mixed[k].nodes) - len(graphs[k].nodes) for k in KINDS},
        "steps": rows,
        "summary": {"steps": len(rows), "pass": counts["pass"], "mismatch": counts["mismatch"],
                    "near_tie": counts["near-tie"], "error": counts["error"], "first_failure": first_failure},
        "culprits": culprits,
        "localization": localization,
        "reference_tokens": [s["token"] for s in stored_steps],
        "target_tokens": target_tokens,
        "first_divergence": first_divergence if free else None,
        "tokenizer": None, "tokenizer_note": NO_TOKENIZER,
        "placement": {k: {"nodes": len(graphs[k].nodes), "on_target": len(graphs[k].nodes) - len(fell_back[k]),
                          "fell_back": len(fell_back[k]), "fell_back_nodes": fell_back[k][:50],
                          **_quantized_placement(graphs[k], fell_back[k])} for k in KINDS},
        "kv_cache": kv_cache(graphs["decode"], platform, target),
        "programs_compiled": sum(r.programs_compiled for r in runners.values()),
        "compiled_per_shape": COMPILED_PER_SHAPE,
        # The first decode step also uploads the decode programs' weights (once per program).
        "upload_bytes_per_decode_step": max(uploads[1:] or uploads) if uploads else None,
        "upload_bytes_first_decode_step": uploads[0] if uploads else None,
        # after the first decode step, which also compiles the decode programs and uploads their weights
        "tokens_per_s": {"target": _steady_rate(target_decode_s), "reference": _steady_rate(reference.decode_s)},
        "quantize": store.quantize,
        "distribution": distribution_agreement(rows, judged=is_quantized(store, graphs["prefill"])),
    })


def kv_cache(graph: Graph, platform, target: str) -> dict:
    """Where the target keeps the decode graph's state between steps: ``{"on_device", "bytes", "note"}``.
    A platform whose caps say ``keeps_tensors: false`` (an external backend: its contract runs programs
    on host tensors) is handed the whole cache again every step, ``bytes`` of it; the note says so."""
    meta = dict(graph.inputs)
    nbytes = sum(meta[name].nbytes for name in graph.state if name in meta)
    try:
        on_device = platform.caps().get("keeps_tensors", True) is not False
    except PlatformError:
        on_device = True
    note = None if on_device else (f"{target} cannot keep tensors on its device between runs: the KV cache "
                                   f"({nbytes} bytes) is passed back in with every step")
    return {"on_device": on_device, "bytes": nbytes, "note": note}


def _float32_twin(store, graphs: dict[str, Graph], params: dict[str, dict]):
    """``(low dtype, stepper of the float32 twin)`` of a float16/bfloat16 generation: the twin
    graphs with their own float32 cache from the upcast parameters (a tensor both graphs share
    is upcast once); ``(None, None)`` for a float32 store."""
    from tapml.driving.regions import low_dtype
    low = low_dtype(store)
    if low is None:
        return None, None
    from tapml.dtypes import as_float32, upcast
    wide: dict[int, object] = {}
    twin_params = {}
    for kind, by_name in params.items():
        twin_params[kind] = {}
        for name, t in by_name.items():
            if id(t) not in wide:
                wide[id(t)] = upcast({name: t}, low)[name]
            twin_params[kind][name] = wide[id(t)]
    return low, _ReferenceStepper(store, {k: as_float32(g, low) for k, g in graphs.items()}, twin_params)


#: Distribution thresholds of a generation (:func:`distribution_agreement`): those a quantized
#: model's logits are judged by everywhere (:data:`tapml.judging.compare.LOGITS_THRESHOLDS`).
DISTRIBUTION_THRESHOLDS = LOGITS_THRESHOLDS


def step_kl(logits, expected) -> float | None:
    """KL(reference || target) of one step's next-token distributions, in nats; None when the
    target's logits hold NaN or infinity (they are no distribution)."""
    kl = float(kl_rows(logits.reshape(-1), expected.reshape(-1))[0])
    return kl if math.isfinite(kl) else None


def distribution_agreement(rows: list[dict], judged: bool) -> dict | None:
    """The ``distribution`` part of a Generation JSON from its step rows (their ``kl``), or None when
    no step ran; ``judged``: its status counts in :func:`passed` (a quantized model's generation)."""
    ran = [r for r in rows if r["target_token"] is not None]  # steps that gave logits
    if not ran:
        return None
    kls = [r["kl"] for r in ran if r.get("kl") is not None]  # None: NaN or infinite logits
    same = sum(r.get("kl") is not None and (r["target_token"] == r["reference_token"] or r["status"] == "near-tie")
               for r in ran)
    doc = {"mean_kl": sum(kls) / len(kls) if kls else 0.0, "max_kl": max(kls, default=0.0),
           "top1_agreement": same / len(ran), "nonfinite": len(ran) - len(kls),
           "thresholds": dict(DISTRIBUTION_THRESHOLDS), "judged": judged}
    ok = doc["nonfinite"] == 0 and doc["mean_kl"] <= DISTRIBUTION_THRESHOLDS["mean_kl"] and \
        doc["top1_agreement"] >= DISTRIBUTION_THRESHOLDS["top1_agreement"]
    return {**doc, "status": "pass" if ok else "fail"}


def passed(doc: dict) -> bool:
    """Every step passed or was a near-tie (the exit code of ``tapml generate`` is 0), and for a
    quantized model the distributions agree within :data:`DISTRIBUTION_THRESHOLDS`."""
    s = doc["summary"]
    dist = doc.get("distribution")
    return s["mismatch"] == 0 and s["error"] == 0 and s["steps"] == doc["tokens"] + 1 and \
        not (dist and dist.get("judged") and dist["status"] != "pass")


def _quantized_placement(graph: Graph, fell_back: list[str]) -> dict:
    """``quantized`` (nodes of tapml's packed-weight ops) and ``quantized_on_target`` (those that ran
    on the target: its packed-weight kernels) of a step graph; nothing for a graph with none."""
    from tapml.quant import packed_op_name
    quantized = [n.name for n in graph.nodes if packed_op_name(n.op)]
    if not quantized:
        return {}
    return {"quantized": len(quantized), "quantized_on_target": len(set(quantized) - set(fell_back))}


def _row(step: int, kind: str, reference_token: int, target_token: int | None, max_abs_err: float | None,
         status: str, message: str) -> dict:
    return {"step": step, "kind": kind, "reference_token": reference_token, "target_token": target_token,
            "max_abs_err": max_abs_err, "status": status, "message": message or "", "kl": None}


def _token_tensor(token: int):
    import torch
    return torch.tensor([[token]], dtype=torch.long)


def _other_step_inputs(store, step: int) -> dict:
    """A step's inputs besides the token (the cache position), as the reference fed them."""
    return {n: t for n, t in store.step_inputs(step).items() if n != "input_ids"}


def _steady_rate(step_seconds: list[float]) -> float | None:
    """Tokens a second over the decode steps after the first (the first compiles the decode
    programs and uploads their weights), or over the one step there is."""
    steady = step_seconds[1:] or step_seconds
    return round(len(steady) / sum(steady), 3) if steady and sum(steady) > 0 else None


def _localize(store, platform, target: str, step: int, kind: str, inputs: dict, outputs: dict, *,
              tolerances: Tolerances, inject: list[str] | None,
              on_event: Callable[[str, dict], None] | None, keep_float32: list[str] = ()) -> tuple[list[dict], dict]:
    """Migrate step ``step``'s graph with the reference's inputs at that step: op stage on the
    graph's cases, then regions with bisection, then the whole step; its culprits, each with
    the step, and a summary of the run."""
    from tapml.driving.migrate import Migration
    view = StepStore(store, kind, inputs, {r: outputs[r] for r in store.step_graph(kind).outputs})
    with tempfile.TemporaryDirectory(prefix="tapml-generate-") as tmp:
        state = Migration(view, platform, target, Path(tmp) / "step.json", tolerances=tolerances, inject=inject,
                          on_event=on_event, keep_float32=keep_float32).run()
    culprits = [{"op": c["op"], "node": c["node"], "module": c["module"], "kind": c["kind"], "step": step,
                 "max_abs_err": c["max_abs_err"], "graph": kind, "nodes": c["nodes"], "message": c["message"]}
                for c in state["culprits"]]
    e = state["end_to_end"] or {}
    return culprits, {"step": step, "graph": kind, "cases": len(state["cases"]), "units": len(state["units"]),
                      "end_to_end": e.get("status"), "placement": state["placement"]["ops_on_target"]}


__all__ = ["generate", "passed", "check_generation_store", "judge_step", "target_placement", "logits_ref",
           "StepStore", "shared_program_inputs", "KINDS", "STEP_STATUSES", "COMPILED_PER_SHAPE", "NO_TOKENIZER"]
