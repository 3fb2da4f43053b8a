"""``tapml generate``: run a generation (prefill, then decode token by token) on a target and
check every step against the reference."""

from __future__ import annotations

import functools
from typing import List, Optional

import typer

from tapml.cli.common import (CacheOpt, TrustRemoteCodeOpt, ChatOpt, PromptFileOpt, PromptIdsOpt, PromptOpt, read_prompt, EXIT_FINDING, EXIT_OK, DtypeOpt, InjectOpt, JsonOpt, KeepFloat32Opt, QuietOpt,
                              StoreDirOpt, TargetOpt, TokenFileOpt, TolOpt, app, check_dtype, command,
                              QuantizeOpt, QuantizedOpsOpt, check_quantize,
                              console, fail, is_store_path, model_store, out, write_json)
from tapml.cli.migrate import HfConfigOpt
from tapml.render import fmt_err, keep_names_whole
from tapml.text import shown

#: Defaults when a MODEL is carved on the fly.
DEFAULT_TOKENS, DEFAULT_PROMPT_LEN = 8, 8



@app.command(name="generate", short_help="Generate token by token on TARGET (prefill, then decode steps against the KV cache) and check every step.")
@command
def generate(model: str = typer.Argument(..., help="A generation store (`tapml carve MODEL --generate N`), or a "
                                                    "causal LM spec (zoo:tiny-llama, hf:gpt2, hf:qwen2...) to carve first"),
             target: str = TargetOpt,
             tokens: Optional[int] = typer.Option(None, "--tokens", help="Decode steps after the prefill: N gives "
                                                  f"N+1 steps (default {DEFAULT_TOKENS}; with a STORE, all it holds)"),
             prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help="Prompt tokens of the prefill "
                                                      f"(default {DEFAULT_PROMPT_LEN}; a STORE has its own)"),
             prompt: Optional[str] = PromptOpt, prompt_file: Optional[str] = PromptFileOpt, chat: bool = ChatOpt,
             prompt_ids: Optional[str] = PromptIdsOpt, cache: Optional[int] = CacheOpt,
             free: bool = typer.Option(False, "--free", help="The target feeds its own tokens (default: every step "
                                       "gets the reference's tokens, teacher-forced)"),
             store_dir: Optional[str] = StoreDirOpt,
             seed: int = typer.Option(0, "--seed", help="Seed for weights and the prompt when carving MODEL"),
             hf_config: Optional[List[str]] = HfConfigOpt, dtype: Optional[str] = DtypeOpt, trust_remote_code: bool = TrustRemoteCodeOpt,
             quantize: Optional[str] = QuantizeOpt, quantized_ops: str = QuantizedOpsOpt,
             localize: bool = typer.Option(True, "--localize/--no-localize", help="Find the culprit of the first "
                                           "failing step with the migration machinery"),
             keep_float32: Optional[List[str]] = KeepFloat32Opt,
             inject: Optional[List[str]] = InjectOpt, tol: Optional[List[str]] = TolOpt,
             token_file: Optional[str] = TokenFileOpt, json_out: Optional[str] = JsonOpt, quiet: bool = QuietOpt):
    """Generate with MODEL on TARGET step by step (prefill, then one decode step per token against
    the key/value cache) and compare every step's logits and token with the reference. Exit 0
    when every step passes (or is a near-tie), 1 on a failure, 2 on bad input."""
    from pathlib import Path

    from tapml.carving import check_store_dtype
    from tapml.judging.compare import Tolerances
    from tapml.driving.generate import check_generation_store, generate as run_generation, passed
    from tapml.driving.inject import parse_faults
    from tapml.frontends.models import parse_hf_overrides
    from tapml.driving.precision import read_keep_items, resolve_keep_float32
    from tapml.driving.targets import check_target, open_target, read_token

    check_target(target)
    tolerances = Tolerances.parse(tol)
    parse_faults(inject or [])
    for name, value in (("--tokens", tokens), ("--prompt-len", prompt_len)):
        if value is not None and value < 1:
            fail(f"{name} {value}: give 1 or more")
    overrides = parse_hf_overrides(hf_config)
    is_store = is_store_path(model)
    dtype = check_dtype(dtype, None if is_store else model, quiet)
    quantize = check_quantize(quantize, model, quantized_ops)
    keep = read_keep_items(keep_float32 or [])
    if keep and not is_store and (dtype or "float32") == "float32":
        fail("--keep-float32 needs a float16/bfloat16 carve: add --dtype float16")
    asked = [name for name, value in (("--prompt", prompt), ("--prompt-file", prompt_file), ("--prompt-ids", prompt_ids))
             if value is not None]
    if is_store and cache is not None:
        fail(f"--cache: store {model} holds the cache it was carved with ({_max_cache_len_of(model)} positions); "
             "give --cache with a MODEL to carve")
    if is_store and asked:
        fail(f"{asked[0]}: store {model} holds the prompt it was carved with; give {asked[0]} with a MODEL to carve")
    from tapml.frontends.checkpoint import is_checkpoint_spec
    from tapml.frontends.prompts import load_tokenizer
    tokenizer = None if is_store else load_tokenizer(model)
    ids = None if is_store else read_prompt(model, prompt=prompt, prompt_file=prompt_file, chat=chat,
                                            prompt_ids=prompt_ids, prompt_len=prompt_len, tokenizer=tokenizer)
    if not is_store:
        tokens = DEFAULT_TOKENS if tokens is None else tokens
        prompt_len = len(ids) if ids else DEFAULT_PROMPT_LEN if prompt_len is None else prompt_len
    carve = functools.partial(_carve, model, tokens=tokens, prompt_len=prompt_len, seed=seed, hf_config=overrides,
                              quiet=quiet, dtype=dtype or "float32", prompt_ids=ids, quantize=quantize,
                              quantized_ops=quantized_ops, cache=cache)
    with model_store(model, store_dir=store_dir, hf_config=hf_config, purpose="generate",
                     what="a generation store", carve=carve) as (store, carved):
        if not carved:
            check_store_dtype(store, dtype)
            tokens = check_generation_store(store, tokens, prompt_len)
        _check_faults(store, inject)
        resolve_keep_float32({k: store.step_graph(k) for k in ("prefill", "decode")}, keep)
        with open_target(target, token=read_token(token_file), inject=inject) as platform:
            doc = run_generation(store, platform, target, tokens=tokens, free=free, tolerances=tolerances,
                                 localize=localize, inject=inject, on_step=_progress(quiet or json_out == "-"),
                                 keep_float32=keep)
        pieces = _add_texts(doc, store, model, tokenizer) if tokenizer is not None else None
        if tokenizer is None and not is_store and is_checkpoint_spec(model):
            doc["tokenizer_note"] = f"no tokenizer in {model} (tokenizer.json; a GGUF: tokenizer.ggml.* metadata): token ids are shown"
    if json_out:
        write_json(doc, json_out)
    if json_out != "-":
        render_generation(doc, quiet, pieces)
    raise typer.Exit(EXIT_OK if passed(doc) else EXIT_FINDING)


def _max_cache_len_of(store_dir: str):
    """The cache positions a generation store was carved with ("?" when it is not one)."""
    from tapml.carving.store import CarveStore
    try:
        return (CarveStore(store_dir).manifest.get("generation") or {}).get("max_cache_len", "?")
    except Exception:  # noqa: BLE001 - only for the message; opening it for real reports what is wrong
        return "?"


def _add_texts(doc: dict, store, model: str, tokenizer) -> tuple[list[str], list[str]]:
    """Add the decoded ``prompt``, ``reference_text`` and ``target_text`` to the Generation JSON;
    returns each stream's per-token pieces for the terminal."""
    from tapml.frontends.prompts import generation_texts, token_pieces
    prompt_ids = store.step_inputs(0)["input_ids"].reshape(-1).tolist()
    doc.update(generation_texts(tokenizer, prompt_ids, doc["reference_tokens"], doc["target_tokens"]))
    doc["tokenizer"] = model
    doc["tokenizer_note"] = f"text decoded with the tokenizer of {model}"
    return token_pieces(tokenizer, doc["reference_tokens"]), token_pieces(tokenizer, doc["target_tokens"])


def _carve(model: str, out_dir, *, tokens: int, prompt_len: int, seed: int, hf_config: dict, quiet: bool,
           dtype: str = "float32", prompt_ids: Optional[list[int]] = None, quantize: Optional[str] = None,
           quantized_ops: str = "whole", cache: Optional[int] = None):
    from tapml.carving.generation import carve_generation
    from tapml.carving.store import CarveStore
    if not quiet:
        in_dtype = ("" if dtype == "float32" else f" in {dtype}") + (f", quantized {quantize}" if quantize else "")
        console.print(f"carving a generation of {shown(model)}{in_dtype}: prompt {prompt_len} tokens, {tokens} decode steps",
                      highlight=False)
    carve_generation(model, out_dir, tokens=tokens, prompt_len=prompt_len, seed=seed, hf_config=hf_config or None,
                     dtype=dtype, prompt_ids=prompt_ids, quantize=quantize, quantized_ops=quantized_ops, cache=cache)
    return CarveStore(out_dir)


def _check_faults(store, inject: Optional[List[str]]) -> None:
    """An --inject fault must name an op (and node) of the prefill or the decode graph."""
    from tapml.errors import TapmlError
    from tapml.driving.migrate import check_faults
    for item in inject or []:
        errors = []
        for kind in ("prefill", "decode"):
            try:
                check_faults(store.step_graph(kind), [item])
                break
            except TapmlError as e:
                errors.append(e)
        else:
            raise errors[0]


def _progress(quiet: bool):
    """One line per step on stderr when stderr is a terminal."""
    if quiet or not console.is_terminal:
        return None

    def show(row: dict) -> None:
        console.print(f"  step {row['step']} {shown(row['kind'])}: {shown(row['status'])}", highlight=False)
    return show


STEP_STYLE = {"pass": "green", "near-tie": "yellow", "mismatch": "red", "error": "bold red"}


def render_texts(doc: dict, pieces: tuple[list[str], list[str]]) -> None:
    """The prompt, then the reference's and the target's text side by side, the target's first
    token that differs from the reference's marked (red, between ⟦ ⟧)."""
    from rich.table import Table
    from rich.text import Text

    from tapml.text import plain_lines
    out.print(Text("prompt: ") + Text(plain_lines(doc["prompt"]), style="dim"))
    table = Table(show_lines=False)
    table.add_column("reference text", overflow="fold", ratio=1)
    table.add_column("target text", overflow="fold", ratio=1)
    ref, got = Text(), Text()
    first = doc.get("first_divergent_token")
    for piece in pieces[0]:
        ref.append(plain_lines(piece))
    for i, piece in enumerate(pieces[1]):
        ref_piece = pieces[0][i] if i < len(pieces[0]) else None
        if i == first:
            got.append(f"⟦{plain_lines(piece)}⟧", style="bold red")
        else:
            got.append(plain_lines(piece), style=None if piece == ref_piece or first is None or i < first else "red")
    table.add_row(ref, got)
    out.print(table)
    if first is not None:
        out.print(f"[yellow]the target's text leaves the reference's at generated token {first}[/]", highlight=False)


def render_generation(doc: dict, quiet: bool = False, pieces: Optional[tuple[list[str], list[str]]] = None) -> None:
    """The two token streams side by side, a row per step, the culprit table, then the summary;
    with ``pieces`` (a tokenizer's), the two texts too (:func:`render_texts`)."""
    from rich.table import Table
    s = doc["summary"]
    if not quiet:
        out.print(f"[bold]{shown(doc['model'])}[/] on [bold]{shown(doc['target'])}[/] "
                  f"({shown(str(doc['device'].get('adapter', '')))}): {doc['mode']}, prompt {doc['prompt_len']} "
                  f"tokens, {doc['tokens']} decode steps", highlight=False)
        ref = doc["reference_tokens"]
        got = doc["target_tokens"]
        width = max([len(str(t)) for t in ref + got] + [1])
        cells_ref = " ".join(str(t).rjust(width) for t in ref)
        cells_got = " ".join((f"[red]{str(t).rjust(width)}[/]" if i >= len(ref) or t != ref[i] else str(t).rjust(width))
                             for i, t in enumerate(got))
        out.print(f"reference: {cells_ref}", highlight=False)
        out.print(f"target:    {cells_got}", highlight=False)
        out.print(f"[dim]({shown(doc['tokenizer_note'])})[/]", highlight=False)
        if pieces is not None:
            render_texts(doc, pieces)
        table = Table(title="steps")
        for col in ("step", "kind", "ref token", "target token", "max_abs_err", "status", "message"):
            table.add_column(col, justify="right" if col in ("step", "ref token", "target token") else "left",
                             overflow="fold")
        for r in doc["steps"]:
            table.add_row(str(r["step"]), shown(r["kind"]), str(r["reference_token"]),
                          "-" if r["target_token"] is None else str(r["target_token"]), fmt_err(r["max_abs_err"]),
                          f"[{STEP_STYLE[r['status']]}]{shown(r['status'])}[/]", shown((r["message"] or "")[:120]))
        out.print(table)
    if doc["culprits"] and not quiet:
        table = Table(title=f"culprits of step {s['first_failure']}")
        for col in ("op", "node", "module", "kind", "step", "max_abs_err"):
            table.add_column(col, overflow="fold")
        for c in doc["culprits"]:
            table.add_row(*map(shown, (c["op"], c["node"], c["module"] or "<root>", c["kind"])), str(c["step"]),
                          fmt_err(c["max_abs_err"]))
        keep_names_whole(table)
        out.print(table)
    if not quiet:
        fell = {k: p["fell_back"] for k, p in doc["placement"].items()}
        upload = doc["upload_bytes_per_decode_step"]
        rates = doc["tokens_per_s"]
        out.print(f"placement: {fell['prefill']} prefill and {fell['decode']} decode nodes fell back to the reference; "
                  f"programs compiled: {doc['programs_compiled']} ({doc['compiled_per_shape']})", highlight=False)
        quantized = {k: p for k, p in doc["placement"].items() if p.get("quantized")}
        if quantized:
            out.print("quantized (" + str(doc.get("quantize") or "packed blocks") + "): " + " and ".join(
                f"{p['quantized_on_target']}/{p['quantized']} {k} linears and embeddings" for k, p in quantized.items())
                + " ran on the target as packed-weight kernels", highlight=False)
        kept = doc.get("keep_float32") or {}
        if any(kept.values()):
            out.print(f"precision: {len(kept.get('prefill', []))} prefill and {len(kept.get('decode', []))} decode "
                      f"nodes kept in float32, the rest in {doc.get('dtype')} "
                      f"({sum((doc.get('casts') or {}).values())} casts added: bookkeeping)", highlight=False)
        out.print(f"uploaded per decode step: {'-' if upload is None else f'{upload} bytes'}; decode tokens/s (the steps "
                  f"after the first, which compiles): target {_rate(rates['target'])}, reference (torch eager, CPU) "
                  f"{_rate(rates['reference'])}", highlight=False)
        if (doc.get("kv_cache") or {}).get("note"):
            out.print(f"[yellow]{shown(doc['kv_cache']['note'])}[/]", highlight=False)
        if doc.get("first_divergence") is not None:
            out.print(f"[yellow]the target's tokens leave the reference's at step {doc['first_divergence']}[/]",
                      highlight=False)
    dist = doc.get("distribution")
    if dist and (dist["judged"] or not quiet):
        t = dist["thresholds"]
        style = "green" if dist["status"] == "pass" else "red"
        what = f"quantized {doc.get('quantize')}: judged" if dist["judged"] else "not judged (float)"
        out.print(f"distribution: mean KL {dist['mean_kl']:.3g} nats (at most {t['mean_kl']:g}), same top-1 "
                  f"{dist['top1_agreement']:.0%} (at least {t['top1_agreement']:.0%}): [{style}]{dist['status']}[/] "
                  f"({what})", highlight=False)
    from tapml.driving.generate import passed
    color = "green" if passed(doc) else "red"
    where = "" if s["first_failure"] is None else f", first failure at step {s['first_failure']}"
    out.print(f"[{color}]{s['pass']}/{doc['tokens'] + 1} steps pass[/], {s['near_tie']} near-tie, {s['mismatch']} "
              f"mismatch, {s['error']} error{where}", highlight=False)


def _rate(x) -> str:
    return "-" if x is None else f"{x:.1f}"


__all__ = ["render_generation"]
