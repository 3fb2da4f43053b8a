"""What every command module of the CLI shares: the Typer ``app``, the consoles, exit codes,
common options, :func:`fail`, the :func:`command` decorator and :func:`write_json`.

Torch, wgpu and transformers are imported inside commands so ``tapml --help`` is instant.
Exit codes: 0 everything checked passed, 1 something did not pass, 2 bad usage or input,
3 an internal error: one line on stderr, the traceback in a private file
(``$XDG_CACHE_HOME/tapml/tapml-crash-*.txt``, else ``~/.cache/tapml/``, else the temp dir), 130 Ctrl-C.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Port PyTorch models to WebGPU, Vulkan, Metal and OpenGL: carve, migrate, verify.")
class _ShowableSegments:
    """A rich render hook: the text of every segment rich is about to write has its control
    characters (ESC, C1, ...) written as visible escapes (:func:`tapml.text.plain`), line breaks
    and tabs kept. Rich's own styles and cursor moves are not text and pass unchanged. This is
    the backstop behind :func:`tapml.text.shown`, which every string from a file or a peer
    goes through before it is put into markup."""

    def process_renderables(self, renderables):
        return [_Showable(r) for r in renderables]


class _Showable:
    def __init__(self, renderable):
        self.renderable = renderable

    def __rich_console__(self, console, options):
        from rich.segment import Segment

        from tapml.text import plain_lines
        for segment in console.render(self.renderable, options):
            yield segment if segment.control else Segment(plain_lines(segment.text), segment.style)


def make_console(**kwargs) -> Console:
    """A rich Console for tapml's output: no emoji codes (user text such as `file.py:boom` must
    print as it is), and control characters in any text written as visible escapes."""
    made = Console(emoji=False, **kwargs)
    made.push_render_hook(_ShowableSegments())
    return made


console = make_console(stderr=True)
out = make_console()

EXIT_OK, EXIT_FINDING, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3

TargetOpt = typer.Option("reference", "--target", "-t", help="reference, wgpu[:vulkan|gl|metal|dx12], browser, remote://HOST:PORT")
TolOpt = typer.Option(None, "--tol", help="Tolerance override OP=RTOL,ATOL or RTOL,ATOL (repeatable)")
InjectOpt = typer.Option(None, "--inject", help="Fault OP[@NODE]=scale:F|offset:F|nan|compile-error (repeatable)")
KernelOpt = typer.Option(None, "--kernel", help="OP=FILE.wgsl: your own WGSL kernel in place of tapml's lowering of OP on "
                         "WGSL targets (wgpu, browser, remote://); binding convention in the README (repeatable)")
TokenFileOpt = typer.Option(None, "--token-file", help="File holding the device server token (else $TAPML_TOKEN)")
TokenMapOpt = typer.Option(None, "--token-map", help='JSON file of a token per device server, '
                           '{"HOST:PORT": "token", "*": "token for the others"} (registry:// pools)')
JsonOpt = typer.Option(None, "--json", help="Write the result as JSON to this file ('-' for stdout)")
StoreDirOpt = typer.Option(None, "--store", help="Keep the store carved from MODEL in this new directory "
                           "(default: a temporary one, removed after)")
QuietOpt = typer.Option(False, "--quiet", "-q", help="Print only errors and the final line")
DtypeOpt = typer.Option(None, "--dtype", help="float32, float16 or bfloat16: the model's floating parameters and "
                        "inputs, and the reference run, in that dtype (default float32; a checkpoint: the dtype it is stored "
                        "in, a GGUF with quantized tensors: float32; a STORE keeps its own). "
                        "Low-precision ops are judged fp64-anchored, regions and the whole model against float32")

QuantizeOpt = typer.Option(None, "--quantize", help="q4_0, q8_0 (llama.cpp's blocks, as gguf writes them), q4f16_1 "
                           "or q4f32_1 (MLC-LLM's): pack every nn.Linear and nn.Embedding of MODEL in that format, "
                           "each one op whose inputs are the packed codes and scales; the reference runs the same "
                           "codes. A model that is a module (not a .pt2 or a STORE); rows must split into groups of 32")
QuantizedOpsOpt = typer.Option("whole", "--quantized-ops", help="With --quantize: whole (each quantized linear "
                               "and embedding one op, what a port runs) or expand (its float chain: the bytes and "
                               "nibbles picked with shifts and masks, the scales applied, then the product, each an "
                               "aten op and a case of its own)")
KeepFloat32Opt = typer.Option(None, "--keep-float32", help="Run these in float32 on the target while the rest runs in "
                              "the low --dtype: a node name, a module path (its floating nodes), an op (aten.x.y: "
                              "every node of it) or a `tapml precision --json` file (its keep_float32 list); "
                              "repeatable. Needs a float16/bfloat16 carve")
TrustRemoteCodeOpt = typer.Option(False, "--trust-remote-code", help="Let a checkpoint whose config.json has "
                                  "auto_map run the Python code it ships (as file.py:factory runs); read that code "
                                  "first. Without it such a checkpoint is refused")
PromptOpt = typer.Option(None, "--prompt", help="The prompt in words, tokenized by the checkpoint's own tokenizer "
                         "(its tokens are the prompt; a generation)")
PromptFileOpt = typer.Option(None, "--prompt-file", help="The prompt read from this UTF-8 text file (as --prompt)")
ChatOpt = typer.Option(False, "--chat", help="Wrap --prompt/--prompt-file as a user message in the tokenizer's chat "
                       "template first")
PromptIdsOpt = typer.Option(None, "--prompt-ids", help="The prompt as token ids, e.g. 1,2,3 (no tokenizer needed)")
CacheOpt = typer.Option(None, "--cache", help="Positions of the static key/value cache (default: the prompt plus "
                        "the generated tokens); a deployment's longest context, e.g. 4096")
DeviceLimitOpt = typer.Option(None, "--device-limit", help="NAME=VALUE: lower a device limit the compiler sees, to "
                              "emulate a smaller device (VALUE in bytes or with KiB/MiB/GiB, e.g. "
                              "max-storage-buffer-binding-size=128MiB); repeatable; a value laxer than the "
                              "device's own is ignored")


def parse_device_limits(items: Optional[list[str]]) -> dict[str, int]:
    """``--device-limit NAME=VALUE`` items as ``{name: int}``: VALUE an integer, optionally with a
    KiB/MiB/GiB suffix; exit 2 naming the known limits for a bad name, value or repeat."""
    import re

    from tapml.platforms.base import LIMIT_NAMES
    known = ", ".join(LIMIT_NAMES)
    limits: dict[str, int] = {}
    for item in items or []:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name not in LIMIT_NAMES:
            fail(f"--device-limit {item[:200]!r}: expected NAME=VALUE with NAME one of: {known}")
        m = re.fullmatch(r"\s*(\d{1,15})\s*(KiB|MiB|GiB)?\s*", value, re.IGNORECASE)
        number = int(m.group(1)) << {"": 0, "kib": 10, "mib": 20, "gib": 30}[(m.group(2) or "").lower()] if m else 0
        if number <= 0:
            fail(f"--device-limit {item[:200]!r}: VALUE must be a positive integer, optionally with KiB, MiB or GiB "
                 "(e.g. 4096 or 128MiB)")
        if name in limits:
            fail(f"--device-limit {name} is given twice; give each limit once")
        limits[name] = number
    return limits


def fail(message: str, code: int = EXIT_USAGE):
    """Print ``message`` as one error line on stderr and exit with ``code`` (default 2, bad usage)."""
    from tapml.text import shown
    console.print(f"[bold red]error:[/] {shown(message, lines=True)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def command(fn):
    """Decorator for every command: TapmlError -> one clear line and exit 2; Ctrl-C -> exit 130;
    any other exception -> ``internal error: TYPE: MESSAGE — details in FILE`` and exit 3, with
    the traceback in FILE (never on the terminal); quiet libraries. Typer's and click's own exits
    (``typer.Exit``, usage errors, aborts) pass through unchanged. A command's
    ``trust_remote_code`` option (:data:`TrustRemoteCodeOpt`) holds for the whole command
    (:func:`tapml.frontends.checkpoint.remote_code_trusted`)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import click

        from tapml.errors import TapmlError
        warnings.filterwarnings("ignore")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from tapml.frontends.checkpoint import remote_code_trusted
        interrupted, restore = _watch_interrupts()
        try:
            with remote_code_trusted(kwargs.get("trust_remote_code") is True):
                result = fn(*args, **kwargs)
        except TapmlError as e:
            if interrupted():
                _interrupted()
            fail(str(e))
        except KeyboardInterrupt:
            _interrupted()
        except (typer.Exit, click.exceptions.Exit, click.exceptions.Abort, click.exceptions.ClickException) as e:
            if interrupted() and getattr(e, "exit_code", None) != 130:  # a Ctrl-C a library swallowed
                _interrupted()
            raise
        except BrokenPipeError:  # `tapml inspect S | head`: the reader left; not a bug of ours
            import sys
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(141)  # 128 + SIGPIPE, as a shell reports it
        except Exception as e:  # noqa: BLE001 - the one place that turns a bug into exit 3
            if interrupted():  # native code (safetensors, wgpu) turns a Ctrl-C into its own error
                _interrupted()
            from tapml.text import shown
            lines = str(e).strip().splitlines()
            summary = type(e).__name__ + (f": {lines[0][:300]}" if lines else "")
            report = write_crash_report(e)
            where = f"details in {report}" if report else "no details file could be written"
            console.print(f"[bold red]internal error:[/] {shown(summary)} — {shown(where)}",
                          highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_INTERNAL)
        else:
            if interrupted():  # a Ctrl-C a library swallowed: the user still asked to stop
                _interrupted()
            return result
        finally:
            restore()
    return wrapper


def _watch_interrupts():
    """Note every SIGINT (then raise KeyboardInterrupt as Python does). Returns ``(interrupted,
    restore)``: whether one came, and a function that puts the previous handlers back. Outside the
    main thread, or when someone else handles SIGINT, nothing is installed.

    A KeyboardInterrupt raised while a finalizer (``__del__``, a weakref callback) runs is
    swallowed by Python; the unraisable hook installed here sends the signal again so that the
    interrupt reaches the command instead of being lost."""
    import signal
    import sys
    import threading
    seen = []
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is not signal.default_int_handler:
        return (lambda: bool(seen)), (lambda: None)

    def on_sigint(signum, frame):
        seen.append(signum)
        signal.default_int_handler(signum, frame)

    previous_hook = sys.unraisablehook
    watching = [True]

    def on_unraisable(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):  # raise it again once the finalizer is done
            again = threading.Timer(0.05, lambda: watching and os.kill(os.getpid(), signal.SIGINT))
            again.daemon = True
            again.start()
        else:
            previous_hook(unraisable)

    def restore():
        watching.clear()
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
    signal.signal(signal.SIGINT, on_sigint)
    sys.unraisablehook = on_unraisable
    return (lambda: bool(seen)), restore


def _interrupted():
    console.print("[yellow]interrupted[/]")
    raise typer.Exit(130)


def write_crash_report(error: BaseException) -> Optional[str]:
    """Write the command line and traceback of ``error`` to a new file only its owner can read
    (mode 0600) under ``$XDG_CACHE_HOME/tapml`` (default ``~/.cache/tapml``), else the temp dir.

    Returns the file's path, or None when neither place is writable.
    """
    import shlex
    import sys
    import tempfile
    import time
    import traceback

    from tapml import version
    text = (f"tapml {version()}, Python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n"
            f"command: {shlex.join(sys.argv)}\n\n" + "".join(traceback.format_exception(error)))
    cache = os.environ.get("XDG_CACHE_HOME", "")
    cache = cache if os.path.isabs(cache) else os.path.join(os.path.expanduser("~"), ".cache")
    name = f"tapml-crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    folders = [Path(cache) / "tapml"] if os.path.isabs(cache) else []  # "~" stays relative without a home
    for folder in folders + [Path(tempfile.gettempdir())]:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
            return str(folder / name)
        except OSError:
            continue
    return None


def write_json(data, path: str) -> None:
    """Write JSON to a file atomically, or to stdout when path is '-'."""
    if path == "-":
        # ASCII only: a control character from a file stays a \u escape, never reaches the terminal
        out.print_json(json.dumps(data, allow_nan=False), ensure_ascii=True)
        return
    from tapml.io import write_json_atomic
    target = Path(path)
    if not target.parent.is_dir():
        fail(f"cannot write {path}: directory {target.parent} does not exist")
    write_json_atomic(target, data)


def check_dtype(dtype: Optional[str], model: Optional[str] = None, quiet: bool = False) -> Optional[str]:
    """A ``--dtype`` value, validated (exit 2 naming the choices otherwise). Not given: the dtype
    a checkpoint MODEL is stored in (said on stderr unless ``quiet``; the checkpoint is checked
    here, so a bad one is refused before anything is written), else None."""
    if dtype is None:
        from tapml.frontends.checkpoint import is_checkpoint_spec, open_checkpoint
        if model is None or not is_checkpoint_spec(model):
            return None
        from tapml.text import shown
        ckpt = open_checkpoint(model)
        quantized = ckpt.gguf.quantized if ckpt.gguf else []
        why = (f"{shown(model)} holds quantized tensors ({', '.join(quantized)}), dequantized to it" if quantized
               else f"the dtype {shown(model)} is stored in")
        if not quiet:
            console.print(f"dtype {ckpt.dtype}: {why} (--dtype to choose another)", highlight=False, soft_wrap=True)
        return ckpt.dtype
    from tapml.dtypes import check_model_dtype
    try:
        return check_model_dtype(dtype)
    except ValueError as e:
        fail(str(e))


def check_quantize(quantize: Optional[str], model: str, quantized_ops: str = "whole") -> Optional[str]:
    """A ``--quantize`` scheme, validated against MODEL (exit 2 naming the schemes, or saying that a
    STORE or a ``.pt2`` keeps the weights it holds), and ``--quantized-ops`` with it."""
    if quantized_ops not in ("whole", "expand"):
        fail(f"--quantized-ops {quantized_ops[:40]!r}: choose whole or expand")
    if quantized_ops != "whole" and quantize is None:
        fail("--quantized-ops expand belongs to --quantize SCHEME: the packed ops it expands")
    if quantize is None:
        return None
    from tapml.quant import SCHEMES
    from tapml.text import shown
    if quantize not in SCHEMES:
        fail(f"--quantize {shown(quantize[:40])}: choose one of {', '.join(SCHEMES)}")
    if is_store_path(model):
        fail(f"--quantize: {shown(model)} is a store, which keeps the weights it was carved with; give a MODEL spec "
             "to carve quantized")
    if str(model).endswith(".pt2"):
        fail(f"--quantize: {shown(model)} is an exported program, whose weights are fixed; give a model that is a "
             "module (zoo:, hf:, a checkpoint, FILE.gguf, file.py:factory)")
    return quantize


@contextlib.contextmanager
def model_store(model: str, *, store_dir: Optional[str], hf_config, purpose: str, what: str, carve):
    """The CarveStore of MODEL|STORE for the block, as ``(store, carved)``: an existing store
    folder as it is (``--store``/``--hf-config`` refused with exit 2), else ``carve(out_dir)``
    (which returns the store) into ``--store DIR`` (a new or empty directory whose parent exists)
    or into a temporary folder removed when the block ends, also when carving fails. ``what``
    names the store kind in messages ("a carve store")."""
    import shutil
    import tempfile

    from tapml.carving import CarveStore
    if is_store_path(model):
        if store_dir or hf_config:
            fail(f"{model} is a store: --store and --hf-config apply when MODEL is a model spec to carve")
        yield CarveStore(model), False
        return
    from tapml.frontends.models import is_model_file
    if Path(model).exists() and not Path(model).is_dir() and not is_model_file(model):
        fail(f"{model} is a file, not {what} or a model spec")
    temporary = None
    if store_dir:
        out_dir = Path(store_dir)
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
            fail(f"--store {store_dir} exists and is not an empty directory; choose another, or pass the "
                 "store itself as MODEL")
        if not out_dir.parent.is_dir():
            fail(f"--store {store_dir}: directory {out_dir.parent} does not exist")
    else:
        temporary = tempfile.mkdtemp(prefix=f"tapml-{purpose}-")
        out_dir = Path(temporary) / "store"
    try:
        yield carve(out_dir), True
    finally:
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)


def is_store_path(model: str) -> bool:
    """Whether MODEL|STORE names a folder to open as a store (a folder that is no checkpoint)."""
    from tapml.frontends.checkpoint import is_checkpoint_folder
    return Path(model).is_dir() and not is_checkpoint_folder(model)


def read_prompt(model: str, *, prompt: Optional[str], prompt_file: Optional[str], chat: bool,
                prompt_ids: Optional[str], prompt_len: Optional[int], tokenizer=None) -> Optional[list[int]]:
    """The token ids of ``--prompt``/``--prompt-file``/``--chat``/``--prompt-ids`` for a generation of
    MODEL (``tokenizer``: MODEL's, :func:`tapml.frontends.prompts.load_tokenizer`), None when no prompt was
    given; exit 2 for a prompt with ``--prompt-len`` (the prompt's tokens are the prompt), or any
    refusal of :func:`tapml.frontends.prompts.prompt_token_ids`."""
    from tapml.frontends.prompts import prompt_token_ids
    ids, _ = prompt_token_ids(model, tokenizer, text=prompt, file=prompt_file, chat=chat, ids=prompt_ids)
    if ids is not None and prompt_len is not None:
        fail(f"--prompt-len {prompt_len}: the prompt's {len(ids)} tokens are the prompt; leave --prompt-len out")
    return ids


def open_store(path: str):
    """The CarveStore at ``path`` (TapmlError, exit 2, when it is missing or corrupt)."""
    from tapml.carving.store import CarveStore
    return CarveStore(path)


def progress_bar(quiet: bool = False):
    """A transient progress bar on stderr; disabled when quiet or stderr is not a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=quiet or not console.is_terminal)


__all__ = ["app", "console", "out", "make_console", "EXIT_OK", "EXIT_FINDING", "EXIT_USAGE", "EXIT_INTERNAL", "TargetOpt", "TolOpt",
           "InjectOpt", "TokenFileOpt", "JsonOpt", "TrustRemoteCodeOpt", "DeviceLimitOpt", "parse_device_limits", "QuietOpt", "DtypeOpt", "QuantizeOpt", "QuantizedOpsOpt", "check_quantize", "KeepFloat32Opt", "check_dtype", "fail", "command", "write_crash_report", "write_json",
           "open_store", "is_store_path", "progress_bar", "read_prompt", "PromptOpt", "PromptFileOpt",
           "ChatOpt", "PromptIdsOpt"]
