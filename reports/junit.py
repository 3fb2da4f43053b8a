"""The report as JUnit XML for CI dashboards: one ``<testsuite>`` per state, one ``<testcase>``
per carved case and per region/model unit. A mismatch is a ``<failure>``, an error an
``<error>``, an unsupported op ``<skipped>``; culprits are named in the failure message."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from tapml.reports.data import StateReport, bench_line, preflight_findings
from tapml.reports.html import fmt_err, fmt_pct, visible_text


def _seconds(ms) -> str:
    return f"{(ms or 0.0) / 1e3:.6f}"


def _details(v: dict) -> str:
    lines = [f"max_abs_err={fmt_err(v.get('max_abs_err'))} max_rel_err={fmt_err(v.get('max_rel_err'))} "
             f"mismatch={fmt_pct(v.get('mismatch_fraction'))}"]
    if v.get("message"):
        lines.append(v["message"])
    for w in v.get("worst") or []:
        if isinstance(w, dict):
            lines.append(f"  at {w.get('index')}: target {w.get('target')} reference {w.get('reference')}")
    return "\n".join(lines)


def _testcase(suite: ET.Element, classname: str, name: str, v: dict, culprit: dict | None) -> str:
    tc = ET.SubElement(suite, "testcase", classname=classname, name=name, time=_seconds(v.get("time_ms")))
    status = v["status"]
    if status == "pass":
        return status
    message = v.get("message") or status
    if culprit is not None:
        message = f"culprit {culprit['op']} in {culprit['module'] or '<root>'} ({culprit['kind']}): {message}"
    tag = {"mismatch": "failure", "error": "error", "unsupported": "skipped", "flaky": "failure"}[status]
    el = ET.SubElement(tc, tag, message=message[:500])
    if tag != "skipped":
        el.set("type", status)
        el.text = _details(v)
    return status


def junit_tree(states: list[StateReport]) -> ET.ElementTree:
    """The JUnit XML document (``<testsuites>``) for one or more states."""
    root = ET.Element("testsuites", name="tapml")
    totals = dict(tests=0, failures=0, errors=0, skipped=0, time=0.0)
    for s in states:
        suite = ET.SubElement(root, "testsuite", name=f"{s.model} on {s.label}")
        props = ET.SubElement(suite, "properties")
        for k, v in (("model", s.model), ("target", s.target), ("adapter", s.device["adapter"]),
                     ("backend", s.device["backend"]), ("features", ",".join(s.device["features"])),
                     ("kind", s.kind), ("source", s.path)):
            ET.SubElement(props, "property", name=k, value=str(v))
        culprit_of = {}
        for f in s.failures:
            if f["culprit"]:
                culprit_of.setdefault(f["unit"], f)
        counts = dict(tests=0, failures=0, errors=0, skipped=0)
        time_ms = 0.0
        checks = [(f"{s.model}.op.{c['op']}", f"{c['id']} {c['node']} [{c['module'] or '<root>'}]", c,
                   culprit_of.get(f"case:{c['id']}")) for c in s.cases]
        checks += [(f"{s.model}.{u['kind']}", f"{u['id']} [{u['module'] or '<root>'}]", u, culprit_of.get(u["id"]))
                   for u in s.units]
        first_culprit = s.failures[0] if s.failures else None
        for x in (s.generation or {}).get("steps", []):  # near-ties are reported, not failures
            status = "pass" if x["status"] == "near-tie" else x["status"]
            checks.append((f"{s.model}.generation.{x['kind']}", f"step {x['step']} {x['kind']}",
                           {**x, "status": status, "message": f"near-tie: {x['message']}" if x["status"] == "near-tie"
                            else x["message"]},
                           first_culprit if status != "pass" and x["step"] == s.generation["summary"]["first_failure"]
                           else None))
        if s.precision is not None:  # the finding is whether the model passes once keep_float32 is applied
            p = s.precision
            checks.append((f"{s.model}.precision", f"end to end in {p['dtype']} with keep_float32 "
                           f"({len(p['keep_float32'])} ops in float32)", p["end_to_end"]["after"], None))
        for x in (s.preflight or {}).get("ops", []):  # over a limit fails, unsupported is skipped
            status = ("error" if x["errors"] else "mismatch" if x["violations"] else
                      "unsupported" if x["unsupported"] else "pass")
            checks.append((f"{s.model}.preflight", f"{x['op']} fits {s.target}",
                           {"status": status, "message": "; ".join(preflight_findings(x))}, None))
        if s.bench is not None:  # a missed goal fails; the benchmark's own verdict is one more check
            b = s.bench
            checks += [(f"{s.model}.bench.goal", f"{g['name']} {g['goal']}",
                        {"status": "mismatch" if g["met"] is False else "pass", "max_abs_err": g["value"],
                         "message": f"{g['name']} is {g['value']}, goal {g['goal']}"}, None) for g in b["goals"]]
            checks.append((f"{s.model}.bench", f"benchmark on {s.target}",
                           {"status": "mismatch" if b["passed"] is False else "pass", "message": bench_line(b)}, None))
        for classname, name, v, culprit in checks:
            status = _testcase(suite, classname, name, v, culprit)
            counts["tests"] += 1
            key = {"mismatch": "failures", "error": "errors", "unsupported": "skipped", "flaky": "failures"}.get(status)
            if key:
                counts[key] += 1
            time_ms += v.get("time_ms") or 0.0
        for k, n in counts.items():
            suite.set(k, str(n))
            totals[k] += n
        suite.set("time", _seconds(time_ms))
        totals["time"] += time_ms
    for k, n in totals.items():
        root.set(k, _seconds(n) if k == "time" else str(n))
    _make_xml_safe(root)
    ET.indent(root)
    return ET.ElementTree(root)


def _make_xml_safe(root: ET.Element) -> None:
    """Write every character XML 1.0 cannot hold (controls, lone surrogates, U+FFFE/U+FFFF)
    as a visible escape in every attribute and text; ElementTree escapes ``<&"`` itself but
    would write those characters raw and make the document unreadable."""
    for el in root.iter():
        for key, value in el.attrib.items():
            el.set(key, visible_text(value))
        if el.text is not None:
            el.text = visible_text(el.text)


def render_junit(states: list[StateReport]) -> str:
    """JUnit XML text (with an XML declaration)."""
    return ET.tostring(junit_tree(states).getroot(), encoding="unicode", xml_declaration=True) + "\n"


__all__ = ["render_junit", "junit_tree"]
