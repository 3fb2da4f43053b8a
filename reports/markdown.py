"""The report as GitHub-flavoured Markdown, compact enough for a pull-request comment."""

from __future__ import annotations

import re

from tapml.reports.data import (STATUSES, StateReport, bench_line, coverage_matrix, precision_modules, preflight_findings,
                                preflight_line)
from tapml.reports.html import fmt_err, fmt_ms, fmt_pct, visible_text

ICON = {"pass": "✅", "mismatch": "❌", "error": "💥", "unsupported": "⚠️", "flaky": "🔀"}

# Inline Markdown syntax, escaped with a backslash wherever it occurs in data: code spans,
# emphasis, strikethrough, links and images, table cells, math, headings, escapes themselves.
# An underscore inside a word is left alone (GFM never reads it as emphasis): `add_3`, not `add\_3`.
_INLINE = re.compile(r"[\\`*\[\]|~$#]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
# What makes a line a block (list item, heading, quote, setext rule) when it starts one.
_BLOCK_START = re.compile(r"^(\d+)([.)])|^([-+=])")
# Text shown as a code span as it is: nothing a code span or a table cell would interpret.
_CODE_SAFE = re.compile(r"[^`|<>&\s]+(?: [^`|<>&\s]+)*")


class Md(str):
    """Text that is already Markdown (made by :func:`md` or :func:`code`): tables keep it as is."""


def md(text, line_start: bool = False) -> Md:
    """``text`` (anything from a state file) as Markdown that shows exactly it: one line (line
    breaks become spaces), controls visible as escapes, HTML characters as entities, Markdown
    syntax backslash-escaped. ``line_start``: the text begins a block, so a leading ``-``, ``+``,
    ``=`` or ``1.`` is escaped too. Example: ``md("<b>|x*")`` -> ``"&lt;b&gt;\\|x\\*"``."""
    flat = " ".join(visible_text(text).replace("\r", "\n").replace("\t", " ").split("\n"))
    out = _INLINE.sub(lambda m: "\\" + m.group(), flat)
    out = "".join(_HTML.get(ch, ch) for ch in out)
    if line_start:
        out = _BLOCK_START.sub(lambda m: f"{m.group(1)}\\{m.group(2)}" if m.group(1) else "\\" + m.group(3), out)
    return Md(out)


def code(text) -> Md:
    """``text`` as a code span when that shows it exactly (op names, module paths), else as
    escaped text in ``<code>`` (still monospace, still one cell, no raw HTML from the data)."""
    text = str(text)
    if _CODE_SAFE.fullmatch(text) and visible_text(text) == text:
        return Md(f"`{text}`")
    return Md(f"<code>{md(text)}</code>")


def _cell(value) -> str:
    """A table cell: Markdown made here as it is, anything else escaped into one line."""
    return value if isinstance(value, Md) else md(value)


def _table(header: list, rows: list[list], align: str = "") -> list[str]:
    align = align or "l" * len(header)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _worst(w: dict) -> str:
    index = w.get("index")
    index = ", ".join(map(str, index)) if isinstance(index, list) else ("" if index is None else str(index))
    return f"\\[{md(index)}\\] target {md(w.get('target'))} vs reference {md(w.get('reference'))}"


def render_markdown(states: list[StateReport], max_rows: int = 60) -> str:
    """Markdown for one or more states: verdict line, findings (culprits first) with their
    worst elements, op coverage when several states are given, and per-op tables. Every value
    from the states is escaped (:func:`md`, :func:`code`): a state file cannot add HTML,
    links, emphasis, lines or table cells to the report."""
    lines = [f"# tapml report: {md(', '.join(sorted({str(s.model) for s in states})))}", ""]
    for s in states:
        if s.precision is not None:
            p = s.precision
            verdict = "✅ passes" if s.passed else "❌ does not pass"
            lines.append(f"**{md(s.model)} in {md(p['dtype'])} on {md(s.label)}** (precision): {len(p['keep_float32'])} "
                         f"ops must stay in float32; with them kept, end to end {verdict}.")
            continue
        if s.preflight is not None:
            lines.append(f"**{md(s.model)} on {md(s.label)}** (preflight): {preflight_line(s.preflight)}.")
            continue
        if s.bench is not None:
            lines.append(f"**{md(s.model)} on {md(s.label)}** (bench): {md(bench_line(s.bench))}.")
            continue
        verdict = "✅ passed" if s.passed else "❌ did not pass"
        if s.generation is not None:
            g = s.generation["summary"]
            lines.append(f"**{md(s.model)} on {md(s.label)}** (generation): {verdict}; {g['steps']} steps, {g['pass']} "
                         f"pass, {g['near_tie']} near-tie, {g['mismatch']} mismatch, {g['error']} error.")
            continue
        summary = s.summary
        counts = ", ".join(f"{summary[k]} {k}" for k in STATUSES)
        lines.append(f"**{md(s.model)} on {md(s.label)}** ({md(s.kind)}): {verdict}; {counts}.")
    lines.append("")

    findings = [(s, f) for s in states for f in s.failures]
    findings.sort(key=lambda sf: not sf[1]["culprit"])
    if findings:
        lines += ["## Findings", ""]
        for s, f in findings:
            where = code(f["module"] or "<root>") + (f" (node {code(f['node'])})" if f["node"] else "")
            tag = "**culprit** " if f["culprit"] else ""
            on = f" on {md(s.label)}" if len(states) > 1 else ""
            lines.append(f"- {ICON.get(f['status'], '')} {tag}{code(f['op'])} {md(f['status'])} ({md(f['kind'])}){on} "
                         f"in {where}: max abs error {fmt_err(f['max_abs_err'])}, max rel error "
                         f"{fmt_err(f['max_rel_err'])}, {fmt_pct(f['mismatch_fraction'])} mismatching")
            if f["message"]:
                lines.append(f"  - {md(f['message'], line_start=True)}")
            worst = [w for w in f["worst"] or [] if isinstance(w, dict)]
            if worst:
                lines.append("  - worst elements: " + "; ".join(_worst(w) for w in worst[:3]))
        lines.append("")

    verdicts = [s for s in states if s.has_cases]
    if len(verdicts) > 1:
        m = coverage_matrix(verdicts)
        lines += ["## Op coverage", ""]
        rows = [[code(r["op"]), r["group"]] + [
            f"{ICON.get(c['status'], '')} {c['pass']}/{c['total']}" + ("" if c["status"] == "pass" else f" {fmt_err(c['max_abs_err'])}")
            if c else "—" for c in r["cells"]] for r in m["rows"]]
        lines += _table(["op", "across targets"] + m["labels"], rows) + [""]

    for s in states:
        if s.precision is not None:
            lines += _precision_lines(s, max_rows)
            continue
        if s.preflight is not None:
            lines += _preflight_lines(s, max_rows)
            continue
        if s.bench is not None:
            lines += _bench_lines(s)
            continue
        shares = s.shares
        lines += [f"## {md(s.model)} on {md(s.label)}", ""]
        dev = s.device
        lines.append(f"- reference: torch eager, {md(s.reference.get('device', 'cpu'))}")
        lines.append(f"- target: {md(s.target)}: {md(dev['adapter'] or '?')} ({md(dev['backend'] or '?')}); "
                     f"features: {md(', '.join(dev['features']) or 'none')}")
        basis = "" if shares["basis"] == "placement" else ", calls whose case passes"
        lines.append(f"- ops on the target: {fmt_pct(shares['ops_share'])} ({md(shares['ops_on_target'])} of "
                     f"{md(shares['ops_total'])}{basis}); FLOPs on the target: {fmt_pct(shares['flops_share'])}")
        if s.dtype_placement and s.dtype_placement["keep_float32"]:
            lines.append(f"- kept in float32: {len(s.dtype_placement['keep_float32'])} nodes, the rest in "
                         f"{md(s.dtype_placement['dtype'])}")
        e2e = s.end_to_end
        lines.append("- end to end: " + (f"{ICON.get(e2e.get('status'), '')} {md(e2e.get('status'))}, max abs error "
                                         f"{fmt_err(e2e.get('max_abs_err'))}" if e2e else "not run"))
        decode = s.decode_units
        if decode:
            e2e = next((u for u in decode if u["kind"] == "model"), None)
            lines.append(f"- decode graph (second pass): {len(decode)} units, "
                         f"{sum(u['status'] == 'pass' for u in decode)} pass; decode step end to end: "
                         + (f"{ICON.get(e2e['status'], '')} {md(e2e['status'])}, max abs error "
                            f"{fmt_err(e2e['max_abs_err'])}" if e2e else "not run"))
        lines.append("")
        if s.generation is not None:
            lines += _generation_lines(s.generation)
        cases = sorted(s.cases, key=lambda c: (c["status"] == "pass", -(c["max_abs_err"] or 0.0)))
        rows = [[c["id"], code(c["op"]), c["node"], c["module"], f"{ICON[c['status']]} {c['status']}",
                 fmt_err(c["max_abs_err"]), fmt_err(c["max_rel_err"]), fmt_pct(c["mismatch_fraction"]),
                 fmt_ms(c["time_ms"])] for c in cases[:max_rows]]
        lines += ["<details><summary>" + f"{len(s.cases)} cases (failures first)" + "</summary>", ""]
        lines += _table(["id", "op", "node", "module", "status", "max abs err", "max rel err", "mismatch", "time ms"],
                        rows, "lllllrrrr")
        if len(cases) > max_rows:
            lines.append(f"\n… and {len(cases) - max_rows} more cases (see the HTML report).")
        lines += ["", "</details>", ""]
        times = [[code(r["op"]), r["instances"], fmt_ms(r["mean_ms"]), fmt_ms(r["ms_per_model"]), fmt_pct(r["share"])]
                 for r in s.op_times()[:15]]
        lines += ["Time per op on the target (top 15):", ""]
        lines += _table(["op", "calls per run", "ms per call", "ms per model run", "share"], times, "lrrrr") + [""]
    return "\n".join(lines)


def _precision_lines(s: StateReport, max_rows: int) -> list[str]:
    """The section of a precision analysis: end to end without and with keep_float32, the list,
    the table by module along the depth of the model, the ops that overflow."""
    p = s.precision
    lines = [f"## {md(s.model)} in {md(p['dtype'])} on {md(s.label)}", ""]
    for label, run in (("end to end", p["end_to_end"]["before"]), ("end to end, keep_float32 applied",
                                                                    p["end_to_end"]["after"])):
        lines.append(f"- {label}: {ICON.get(run['status'], '')} {md(run['status'])}, max abs error "
                     f"{fmt_err(run['max_abs_err'])}" + (f" ({md(run['message'][:200])})" if run["message"] else ""))
    keep = ", ".join(code(k) for k in p["keep_float32"]) or "none"
    lines.append(f"- keep_float32 ({len(p['keep_float32'])}): {keep}")
    if p["keep_float32_modules"]:
        lines.append("- whole modules kept: " + ", ".join(code(m or "<root>") for m in p["keep_float32_modules"]))
    lines += ["", f"Headroom (largest finite {md(p['dtype'])} / largest float32 activation; below 1 it does not fit) "
              "and error against float64, by module along the depth of the model:", ""]
    rows = [[r["depth"], code(r["module"] or "<root>"), r["ops"], fmt_err(r["max_abs"]), fmt_err(r["headroom"]),
             r["overflow"], r["absorbed"], r["kept"], fmt_err(r["err_vs_fp64"])] for r in precision_modules(p)]
    lines += _table(["depth", "module", "ops", "max abs", "headroom", "overflow", "absorbed", "kept", "err vs fp64"],
                    rows[:max_rows], "rlrrrrrrr")
    if len(rows) > max_rows:
        lines.append(f"\n… and {len(rows) - max_rows} more modules (see the HTML report).")
    bad = [x for x in p["ops"] if x["overflow"]]
    if bad:
        lines += ["", "Ops that overflow on the target:", ""]
        lines += _table(["op", "node", "module", "max abs", "headroom", "absorbed"],
                        [[code(x["op"]), code(x["node"]), code(x["module"] or "<root>"), fmt_err(x["max_abs"]),
                          fmt_err(x["headroom"]), "yes" if x["absorbed"] else ""] for x in bad[:max_rows]], "lllrrl")
    return lines + [""]


def _preflight_lines(s: StateReport, max_rows: int) -> list[str]:
    """The section of a preflight: the device limits it checked against, then per op what
    splits and what is over a limit, unsupported or failed to compile (ops that simply fit last)."""
    p = s.preflight
    forced = ", ".join(f"{k}={v}" for k, v in sorted(p["forced_limits"].items()))
    lines = [f"## Preflight of {md(s.model)} on {md(s.label)}", "",
             f"- {preflight_line(p)}",
             f"- device: {md(s.device['adapter'] or '?')} ({md(s.device['backend'] or '?')})"
             + (f"; forced limits: {md(forced)}" if forced else ""), ""]
    ops = sorted(p["ops"], key=lambda x: (x["fits"], not x["splits"]))
    rows = [[code(x["op"]), x["cases"], x["kernels"], x["largest_binding"],
             "✅ fits" if x["fits"] else "❌ does not fit", md("; ".join(preflight_findings(x)) or "—")]
            for x in ops[:max_rows]]
    lines += _table(["op", "cases", "kernels", "largest binding (bytes)", "fits", "splits and limits"], rows, "lrrrll")
    if len(ops) > max_rows:
        lines.append(f"\n… and {len(ops) - max_rows} more ops (see the HTML report).")
    return lines + [""]


def _bench_lines(s: StateReport) -> list[str]:
    """The section of a benchmark: its goals (met or missed), then every figure it measured."""
    b = s.bench
    lines = [f"## Benchmark {md(s.model)} on {md(s.label)}", "", f"- {md(bench_line(b))}", ""]
    if b["goals"]:
        lines += _table(["goal", "bound", "value", "met"],
                        [[md(g["name"]), md(g["goal"]), fmt_err(g["value"]),
                          {True: "✅ met", False: "❌ missed", None: "—"}[g["met"]]] for g in b["goals"]], "llrl") + [""]
    lines += _table(["figure", "value"], [[code(f["name"]), md(f["value"])] for f in b["figures"]], "lr")
    return lines + [""]


def _generation_lines(g: dict) -> list[str]:
    """The generation section: figures, the step table, the culprits."""
    sm = g["summary"]
    first = "none" if sm["first_failure"] is None else f"step {sm['first_failure']}"
    rates = g["tokens_per_s"]
    lines = [f"### Generation: {sm['steps']} steps, {sm['pass']} pass, {sm['near_tie']} near-tie, "
             f"{sm['mismatch']} mismatch, {sm['error']} error; first failure: {first}", "",
             f"- programs compiled: {md(g['programs_compiled'])}; bytes uploaded per decode step: "
             f"{md(g['upload_bytes_per_decode_step'])}; decode tokens/s: {md(rates['target'])} "
             f"(reference {md(rates['reference'])})", ""]
    icon = {"near-tie": "🟰"}
    rows = [[x["step"], x["kind"], md(x["reference_token"]), md(x["target_token"]), fmt_err(x["max_abs_err"]),
             f"{icon.get(x['status'], ICON.get(x['status'], ''))} {x['status']}", md(x["message"][:120])]
            for x in g["steps"]]
    lines += _table(["step", "kind", "reference token", "target token", "max abs err", "status", "message"],
                    rows, "rlrrrll") + [""]
    if g["culprits"]:
        rows = [[md(c.get("step")), md(c.get("graph") or "—"), md(c["kind"]), code(c["op"]), code(c["node"]),
                 code(c["module"] or "<root>"), fmt_err(c["max_abs_err"])] for c in g["culprits"]]
        lines += ["Culprits of the first failing step:", ""]
        lines += _table(["step", "graph", "kind", "op", "node", "module", "max abs err"], rows, "rllllll") + [""]
    return lines


__all__ = ["render_markdown", "md", "code", "Md"]
