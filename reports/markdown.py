"""The report as GitHub-flavoured Markdown, compact enough for a pull-request comment."""

from __future__ import annotations

from tapml.reports.data import STATUSES, StateReport, coverage_matrix
from tapml.reports.html import fmt_err, fmt_ms, fmt_pct

ICON = {"pass": "✅", "mismatch": "❌", "error": "💥", "unsupported": "⚠️"}


def _cell(text) -> str:
    """Table cell text: pipes escaped, one line."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list], align: str = "") -> list[str]:
    align = align or "l" * len(header)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def render_markdown(states: list[StateReport], max_rows: int = 60) -> str:
    """Markdown for one or more states: verdict line, findings (culprits first) with their
    worst elements, op coverage when several states are given, and per-op tables."""
    lines = [f"# tapml report: {', '.join(sorted({s.model for s in states}))}", ""]
    for s in states:
        summary = s.summary
        verdict = "✅ passed" if s.passed else "❌ did not pass"
        counts = ", ".join(f"{summary[k]} {k}" for k in STATUSES)
        lines.append(f"**{s.model} on {s.label}** ({s.kind}): {verdict}; {counts}.")
    lines.append("")

    findings = [(s, f) for s in states for f in s.failures]
    findings.sort(key=lambda sf: not sf[1]["culprit"])
    if findings:
        lines += ["## Findings", ""]
        for s, f in findings:
            where = f"`{f['module'] or '<root>'}`" + (f" (node `{f['node']}`)" if f["node"] else "")
            tag = "**culprit** " if f["culprit"] else ""
            on = f" on {s.label}" if len(states) > 1 else ""
            lines.append(f"- {ICON.get(f['status'], '')} {tag}`{f['op']}` {f['status']} ({f['kind']}){on} in {where}: "
                         f"max abs error {fmt_err(f['max_abs_err'])}, max rel error {fmt_err(f['max_rel_err'])}, "
                         f"{fmt_pct(f['mismatch_fraction'])} mismatching")
            if f["message"]:
                lines.append(f"  - {f['message']}")
            if f["worst"]:
                lines.append("  - worst elements: " + "; ".join(
                    f"[{', '.join(map(str, w.get('index', [])))}] target {w.get('target')} vs reference "
                    f"{w.get('reference')}" for w in f["worst"][:3]))
        lines.append("")

    if len(states) > 1:
        m = coverage_matrix(states)
        lines += ["## Op coverage", ""]
        rows = [[f"`{r['op']}`"] + [f"{ICON[c['status']]} {c['pass']}/{c['total']}" if c else "—" for c in r["cells"]]
                for r in m["rows"]]
        lines += _table(["op"] + m["labels"], rows) + [""]

    for s in states:
        shares = s.shares
        lines += [f"## {s.model} on {s.label}", ""]
        dev = s.device
        lines.append(f"- reference: torch eager, {s.reference.get('device', 'cpu')}")
        lines.append(f"- target: {s.target}: {dev['adapter'] or '?'} ({dev['backend'] or '?'}); features: "
                     f"{', '.join(dev['features']) or 'none'}")
        lines.append(f"- ops on the target: {fmt_pct(shares['ops_share'])} ({shares['ops_on_target']} of "
                     f"{shares['ops_total']}{'' if shares['basis'] == 'placement' else ', calls whose case passes'})"
                     f"; FLOPs on the target: {fmt_pct(shares['flops_share'])}")
        e2e = s.end_to_end
        lines.append("- end to end: " + (f"{ICON.get(e2e.get('status'), '')} {e2e.get('status')}, max abs error "
                                         f"{fmt_err(e2e.get('max_abs_err'))}" if e2e else "not run"))
        lines.append("")
        cases = sorted(s.cases, key=lambda c: (c["status"] == "pass", -(c["max_abs_err"] or 0.0)))
        rows = [[c["id"], f"`{c['op']}`", c["node"], c["module"], f"{ICON[c['status']]} {c['status']}",
                 fmt_err(c["max_abs_err"]), fmt_err(c["max_rel_err"]), fmt_pct(c["mismatch_fraction"]),
                 fmt_ms(c["time_ms"])] for c in cases[:max_rows]]
        lines += ["<details><summary>" + f"{len(s.cases)} cases (failures first)" + "</summary>", ""]
        lines += _table(["id", "op", "node", "module", "status", "max abs err", "max rel err", "mismatch", "time ms"],
                        rows, "lllllrrrr")
        if len(cases) > max_rows:
            lines.append(f"\n… and {len(cases) - max_rows} more cases (see the HTML report).")
        lines += ["", "</details>", ""]
        times = [[f"`{r['op']}`", r["instances"], fmt_ms(r["mean_ms"]), fmt_ms(r["ms_per_model"]), fmt_pct(r["share"])]
                 for r in s.op_times()[:15]]
        lines += ["Time per op on the target (top 15):", ""]
        lines += _table(["op", "calls per run", "ms per call", "ms per model run", "share"], times, "lrrrr") + [""]
    return "\n".join(lines)


__all__ = ["render_markdown"]
