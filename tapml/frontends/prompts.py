"""Prompts in words and generations as text: a checkpoint's own tokenizer.

A GGUF file's tokenizer is the one transformers builds from its metadata
(:func:`tapml.frontends.gguf.load_gguf_tokenizer`).

A checkpoint folder (or ``hf:ORG/NAME``, :mod:`tapml.frontends.checkpoint`) that holds a tokenizer
(``tokenizer.json``, ``tokenizer_config.json``...) is read with transformers' ``AutoTokenizer``,
local files only; each of those files must be a regular file inside the folder, and a
``tokenizer_config.json`` with ``auto_map`` (tokenizer code shipped with the checkpoint) is refused
unless remote code is trusted. :func:`prompt_token_ids` turns ``--prompt`` / ``--prompt-file`` /
``--chat`` / ``--prompt-ids`` into the prompt's token ids; :func:`generation_texts` decodes a
generation's token streams and finds the first token where the target leaves the reference.

Example::

    tokenizer = load_tokenizer("./my-llama")             # None when the folder has none
    ids, text = prompt_token_ids("./my-llama", tokenizer, text="Hello world", chat=True)
"""

from __future__ import annotations

import os

from tapml.errors import TapmlError

#: Files a tokenizer may be read from; each present one is checked before transformers reads it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
#: Most bytes read from a --prompt-file.
MAX_PROMPT_BYTES = 1 << 20


def load_tokenizer(spec: str):
    """The tokenizer of the checkpoint ``spec``, or None when ``spec`` is no checkpoint or its
    folder holds no tokenizer. TapmlError (exit 2) when a tokenizer file leaves the folder, when
    its config has ``auto_map`` without trusted remote code, or when transformers cannot read it."""
    from tapml.frontends.checkpoint import _inside, is_checkpoint_spec, open_checkpoint, remote_code_is_trusted
    if not is_checkpoint_spec(spec):
        return None
    ckpt = open_checkpoint(spec)
    if ckpt.gguf:
        from tapml.frontends.gguf import load_gguf_tokenizer
        return load_gguf_tokenizer(ckpt)
    present = [name for name in TOKENIZER_FILES if os.path.lexists(ckpt.folder / name)]
    if not any(name in present for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    for name in present:
        _inside(spec, ckpt.folder / name, ckpt.root)
    trusted = remote_code_is_trusted()
    if "tokenizer_config.json" in present:
        import json

        from tapml.io import read_regular_file
        raw = read_regular_file(ckpt.folder / "tokenizer_config.json", f"{spec}/tokenizer_config.json",
                                "copy the checkpoint again", max_bytes=16 << 20)
        try:  # not tapml's strict reader: transformers writes model_max_length as 10**30, past 64 bits
            config = json.loads(raw)
        except (ValueError, RecursionError):
            raise TapmlError(f"{spec}/tokenizer_config.json is not valid JSON; copy the checkpoint again") from None
        if isinstance(config, dict) and "auto_map" in config and not trusted:
            raise TapmlError(f"{spec}: its tokenizer_config.json has auto_map, so loading the tokenizer runs Python "
                             "code shipped with the checkpoint; tapml runs it only with --trust-remote-code")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(ckpt.folder), local_files_only=True, trust_remote_code=trusted)
    except Exception as e:  # noqa: BLE001 - a tokenizer transformers cannot read is bad input
        raise TapmlError(f"{spec}: transformers cannot read its tokenizer: {type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0][:300]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def parse_prompt_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; TapmlError saying the form otherwise."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise TapmlError(f"--prompt-ids {text[:80]!r}: give token ids separated by commas, e.g. 1,2,3") from None
    if not ids or any(i < 0 or i >= 1 << 31 for i in ids):
        raise TapmlError(f"--prompt-ids {text[:80]!r}: token ids are integers from 0, e.g. 1,2,3")
    return ids


def read_text_file(path: str, option: str) -> str:
    """The UTF-8 text of the regular file ``path`` given with ``option`` (at most
    :data:`MAX_PROMPT_BYTES`); TapmlError (exit 2) naming the option otherwise."""
    from tapml.io import read_regular_file
    raw = read_regular_file(path, f"{option} {path}", max_bytes=MAX_PROMPT_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TapmlError(f"{option} {path} is not UTF-8 text") from None


def prompt_token_ids(spec: str, tokenizer, *, text: str | None = None, file: str | None = None,
                     chat: bool = False, ids: str | None = None) -> tuple[list[int] | None, str | None]:
    """``(token ids, prompt text)`` of the prompt asked for, ``(None, None)`` when none was.

    ``text`` (``--prompt``) or the UTF-8 text of ``file`` (``--prompt-file``) is tokenized with
    ``tokenizer``; ``chat`` first wraps it as one user message in the tokenizer's chat template
    (with the generation prompt). ``ids`` (``--prompt-ids 1,2,3``) needs no tokenizer. TapmlError
    for two prompts at once, ``chat`` without a text prompt or a chat template, a text prompt
    without a tokenizer, an empty prompt."""
    given = [name for name, value in (("--prompt", text), ("--prompt-file", file), ("--prompt-ids", ids))
             if value is not None]
    if len(given) > 1:
        raise TapmlError(f"{' and '.join(given)}: give one prompt")
    if chat and not (text is not None or file is not None):
        raise TapmlError("--chat applies the tokenizer's chat template to --prompt or --prompt-file; give one")
    if ids is not None:
        return parse_prompt_ids(ids), None
    if text is None and file is None:
        return None, None
    if file is not None:
        text = read_text_file(file, "--prompt-file")
    if tokenizer is None:
        raise TapmlError(f"{spec} has no tokenizer (a checkpoint folder with tokenizer.json has one, a GGUF file "
                         "with tokenizer.ggml.* metadata too), so a prompt in words cannot be tokenized; give token "
                         "ids with --prompt-ids 1,2,3")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise TapmlError(f"--chat: the tokenizer of {spec} has no chat template; leave --chat out")
        try:
            out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
        except Exception as e:  # noqa: BLE001 - a template that fails on this prompt is bad input
            raise TapmlError(f"--chat: the chat template of {spec} fails: {type(e).__name__}: {str(e)[:200]}") \
                from None
        token_ids = list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    else:
        token_ids = list(tokenizer(text)["input_ids"])
    if not token_ids:
        raise TapmlError("the prompt is empty once tokenized; give a prompt with some text")
    return [int(i) for i in token_ids], text


def generation_texts(tokenizer, prompt_ids: list[int], reference_tokens: list[int],
                     target_tokens: list[int]) -> dict:
    """``{"prompt", "reference_text", "target_text", "first_divergent_token"}``: the decoded prompt
    and token streams, and the index of the first generated token where the target's differs
    from the reference's (None when none does)."""
    first = next((i for i, (r, t) in enumerate(zip(reference_tokens, target_tokens)) if r != t),
                 None if len(target_tokens) >= len(reference_tokens) else len(target_tokens))
    return {"prompt": tokenizer.decode(prompt_ids), "reference_text": tokenizer.decode(reference_tokens),
            "target_text": tokenizer.decode(target_tokens), "first_divergent_token": first}


def token_pieces(tokenizer, tokens: list[int]) -> list[str]:
    """The text each token adds to the decoded stream (so the pieces join to the whole text)."""
    pieces, before = [], ""
    for i in range(len(tokens)):
        text = tokenizer.decode(tokens[:i + 1])
        pieces.append(text[len(before):] if text.startswith(before) else tokenizer.decode(tokens[i:i + 1]))
        before = text
    return pieces


__all__ = ["load_tokenizer", "prompt_token_ids", "read_text_file", "parse_prompt_ids", "generation_texts", "token_pieces",
           "TOKENIZER_FILES", "MAX_PROMPT_BYTES"]
