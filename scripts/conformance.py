#!/usr/bin/env python3
"""Conformance run: torch's own operator samples (the OpInfo database of torch's test suite)
through tapml as a user would meet them: each sample becomes a one-op model, exported with
torch.export, carved (``tapml carve``) and replayed on a target (``tapml replay``).

Usage::

    .venv/bin/python scripts/conformance.py --target wgpu:vulkan --out conformance/ [--ops add sort] [--samples 1]

Writes ``OUT/results.jsonl`` (one line per sample: op, variant, sample index, the carve's and the
replay's exit codes and each case's verdict) and prints a summary. A killed run resumes: samples
already in results.jsonl are skipped. Exits 1 when a sample crashed tapml (exit 3 or a traceback)
or a case was a mismatch or an error; unsupported verdicts and exit-2 refusals (what torch.export
does not accept, what a store cannot hold) are listed, not failures.

Needs ``expecttest`` (in the dev extras): torch's OpInfo database imports it. The factories it
writes import the database: they are code, like every ``path/file.py:factory`` spec.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import textwrap
from pathlib import Path

FACTORY = textwrap.dedent('''
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    OP = next(o for o in op_db if (o.name, o.variant_test_name) == ({name!r}, {variant!r}))


    def factory():
        torch.manual_seed(0)
        sample = list(OP.sample_inputs("cpu", torch.float32))[{index}]
        leaves, spec = torch.utils._pytree.tree_flatten((sample.input, sample.args, sample.kwargs))

        class OneOp(torch.nn.Module):
            def forward(self, *tensors):
                it = iter(tensors)
                values = [next(it) if isinstance(v, torch.Tensor) else v for v in leaves]
                first, args, kwargs = torch.utils._pytree.tree_unflatten(values, spec)
                return OP.op(first, *args, **kwargs)
        return OneOp(), tuple(v for v in leaves if isinstance(v, torch.Tensor))
''')


def _crashed(result) -> bool:
    return result.exit_code == 3 or "Traceback" in result.output or (
        result.exception is not None and not isinstance(result.exception, SystemExit))


def run(target: str, out: Path, ops: list[str] | None, samples: int) -> list[dict]:
    """Carve and replay the samples; returns every result record (earlier runs' included)."""
    import torch
    from torch.testing._internal.common_methods_invocations import op_db
    from typer.testing import CliRunner

    from tapml.cli import app
    out.mkdir(parents=True, exist_ok=True)
    log = out / "results.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    done = {(r["op"], r["variant"], r["index"]) for r in records}
    runner = CliRunner()
    with log.open("a") as sink:
        for n, info in enumerate(op_db):
            if (ops and info.name not in ops) or torch.float32 not in info.supported_dtypes("cpu"):
                continue
            torch.manual_seed(0)
            count = len(list(info.sample_inputs("cpu", torch.float32)))
            for index in range(min(count, samples)):
                if (info.name, info.variant_test_name, index) in done:
                    continue
                factory, store, verdicts = out / f"op{n}_{index}.py", out / f"store{n}_{index}", out / f"v{n}_{index}.json"
                factory.write_text(FACTORY.format(name=info.name, variant=info.variant_test_name, index=index))
                carved = runner.invoke(app, ["carve", f"{factory}:factory", "-o", str(store)])
                record = {"op": info.name, "variant": info.variant_test_name, "index": index,
                          "carve": carved.exit_code, "crashed": _crashed(carved), "message": carved.output[-300:]}
                if carved.exit_code == 0:
                    replayed = runner.invoke(app, ["replay", str(store), "--target", target, "--json", str(verdicts), "-q"])
                    record.update(replay=replayed.exit_code, crashed=_crashed(replayed), message=replayed.output[-300:])
                    if verdicts.exists():
                        record["cases"] = [[c["op"], c["status"], c["message"][:200]]
                                           for c in json.loads(verdicts.read_text())["cases"]]
                shutil.rmtree(store, ignore_errors=True)
                verdicts.unlink(missing_ok=True)
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                records.append(record)
    return records


def summary(records: list[dict]) -> tuple[str, bool]:
    """The printed summary, and whether the run found nothing wrong."""
    statuses = collections.Counter(s for r in records for _, s, _ in r.get("cases", []))
    crashed = [r for r in records if r["crashed"]]
    wrong = [(r["op"], op, s, m) for r in records for op, s, m in r.get("cases", []) if s in ("mismatch", "error")]
    refused = collections.Counter(r["message"].strip().splitlines()[-1][:140] for r in records if r["carve"] == 2)
    unsupported = collections.Counter((op, m[:120]) for r in records for op, s, m in r.get("cases", [])
                                      if s == "unsupported")
    lines = [f"{len(records)} samples: {sum(r['carve'] == 0 for r in records)} carved, "
             f"{sum(r['carve'] == 2 for r in records)} refused at carve (exit 2), {len(crashed)} crashed; "
             f"cases: {dict(statuses)}"]
    lines += [f"  crashed: {r['op']} {r['variant']} #{r['index']}: {r['message'][-200:]}" for r in crashed]
    lines += [f"  {s}: {op} in {sample}: {m}" for sample, op, s, m in wrong]
    lines += [f"  refused x{k}: {why}" for why, k in refused.most_common()]
    lines += [f"  unsupported x{k}: {op}: {why}" for (op, why), k in unsupported.most_common()]
    return "\n".join(lines), not crashed and not wrong


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="wgpu:vulkan")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ops", nargs="*", help="OpInfo names (default: every op that takes float32)")
    parser.add_argument("--samples", type=int, default=1, help="samples per op (default 1)")
    args = parser.parse_args(argv)
    text, clean = summary(run(args.target, args.out, args.ops, args.samples))
    print(text)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
