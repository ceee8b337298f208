"""Machine-readable writers for findings: JSON, JUnit XML, GitHub Actions annotations.

They take a check report (``zeroplan.advice.check.CheckReport`` or anything shaped like it):
``report.files`` — each with ``path``, ``findings`` (``rule_id``, ``severity``, ``message``,
``line``), ``rules`` (rule IDs evaluated for that file), ``error`` (a message when the file could
not be read) — plus ``report.fail_on`` and ``report.rule_descriptions``.

- JSON: one object (the report's ``model_dump``).
- JUnit XML: ``<testsuites>`` with one ``<testsuite>`` per config file and one ``<testcase>`` per
  rule evaluated; a ``<failure message type>`` where the rule has findings at or above the fail
  level, ``<system-out>`` for findings below it, an ``<error>`` when the file could not be read.
  Attributes required by the JUnit schema: testsuites(tests, failures, errors),
  testsuite(name, tests, failures, errors), testcase(name, classname), failure(message, type).
- GitHub: workflow commands ``::error file=PATH,line=L,title=ZP101::message`` (``::warning``,
  ``::notice`` for info). Escaping per GitHub's toolkit (``@actions/core`` command.ts): in the
  message ``%`` → ``%25``, ``\\r`` → ``%0D``, ``\\n`` → ``%0A``; in property values also ``:`` →
  ``%3A`` and ``,`` → ``%2C``.

``key_lines`` / ``find_key_line`` (specs/config_lines.py, re-exported here) map each dotted key of
a JSON(-with-comments) file to the line it is on, so annotations point at the offending key.
"""

from __future__ import annotations

import json
from typing import Any
from xml.etree import ElementTree as ET

from zeroplan.specs.config_lines import find_key_line, key_lines  # re-exported
from zeroplan.specs.findings import SEVERITY_ORDER

__all__ = [
    "key_lines",
    "find_key_line",
    "escape_github_data",
    "escape_github_property",
    "to_json",
    "to_junit",
    "to_github",
    "GITHUB_LEVEL",
    "summary_line",
]

GITHUB_LEVEL = {"error": "error", "warning": "warning", "info": "notice"}


# --------------------------------------------------------------------------------------------
# GitHub workflow commands
# --------------------------------------------------------------------------------------------

def escape_github_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_github_property(s: str) -> str:
    return escape_github_data(s).replace(":", "%3A").replace(",", "%2C")


def to_github(report: Any) -> str:
    """One workflow command per finding, then a plain summary line."""
    lines = []
    for f in report.files:
        for x in f.findings:
            props = [f"file={escape_github_property(f.path)}"]
            if getattr(x, "line", None):
                props.append(f"line={int(x.line)}")
            props.append(f"title={escape_github_property(x.rule_id)}")
            lines.append(f"::{GITHUB_LEVEL.get(x.severity, 'notice')} {','.join(props)}::{escape_github_data(x.message)}")
    lines.append(summary_line(report))
    return "\n".join(lines) + "\n"


def summary_line(report: Any) -> str:
    counts = {"error": 0, "warning": 0, "info": 0}
    for f in report.files:
        for x in f.findings:
            counts[x.severity] = counts.get(x.severity, 0) + 1
    return (f"zeroplan check: {report.verdict.upper()} — {len(report.files)} config(s), {counts['error']} error(s), "
            f"{counts['warning']} warning(s), {counts['info']} info (failing at {report.fail_on})")


# --------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------

def to_json(report: Any) -> str:
    obj = report.model_dump(mode="json") if hasattr(report, "model_dump") else report
    return json.dumps(obj, indent=2, allow_nan=False) + "\n"


# --------------------------------------------------------------------------------------------
# JUnit XML
# --------------------------------------------------------------------------------------------

def to_junit(report: Any) -> str:
    """JUnit XML: one testsuite per config file, one testcase per rule evaluated."""
    fail_level = SEVERITY_ORDER[report.fail_on]
    descr = getattr(report, "rule_descriptions", {}) or {}
    root = ET.Element("testsuites", name="zeroplan check")
    t_tests = t_fail = t_err = 0
    for f in report.files:
        suite = ET.SubElement(root, "testsuite", name=f.path)
        tests = failures = errors = 0
        classname = "zeroplan.check." + f.path.replace("/", ".").replace("\\", ".")
        by_rule: dict[str, list[Any]] = {}
        for x in f.findings:
            by_rule.setdefault(x.rule_id, []).append(x)
        rules = list(f.rules)
        for rid in by_rule:
            if rid not in rules:
                rules.append(rid)
        for rid in rules:
            tests += 1
            name = f"{rid} {descr.get(rid, '')}".strip()
            case = ET.SubElement(suite, "testcase", name=name, classname=classname, time="0")
            found = by_rule.get(rid, [])
            if getattr(f, "error", None) and rid == "ZP000":
                errors += 1
                el = ET.SubElement(case, "error", message=found[0].message if found else f.error, type="ZP000")
                el.text = f.error
                continue
            failing = [x for x in found if SEVERITY_ORDER[x.severity] >= fail_level]
            below = [x for x in found if SEVERITY_ORDER[x.severity] < fail_level]
            if failing:
                failures += 1
                worst = max(failing, key=lambda x: SEVERITY_ORDER[x.severity])
                el = ET.SubElement(case, "failure", message=worst.message, type=f"{rid} {worst.severity}")
                el.text = "\n".join(_finding_line(f.path, x) for x in failing)
            if below:
                out = ET.SubElement(case, "system-out")
                out.text = "\n".join(_finding_line(f.path, x) for x in below)
        suite.set("tests", str(tests))
        suite.set("failures", str(failures))
        suite.set("errors", str(errors))
        suite.set("skipped", "0")
        suite.set("time", "0")
        t_tests += tests
        t_fail += failures
        t_err += errors
    root.set("tests", str(t_tests))
    root.set("failures", str(t_fail))
    root.set("errors", str(t_err))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _finding_line(path: str, x: Any) -> str:
    where = f"{path}:{x.line}" if getattr(x, "line", None) else path
    key = f" [{x.key}]" if getattr(x, "key", "") else ""
    return f"{where}: {x.severity} {x.rule_id}{key}: {x.message}"
