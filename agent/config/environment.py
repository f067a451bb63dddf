"""The configuration's keys as environment variables, and the layers put
together: defaults, the file, the environment (load_layers).

MMTRACE_<KEY> sets a top-level key and MMTRACE_<SECTION>_<KEY> a key of
[p99], [entropy], [failures], [memory], [hangs], [diagnosis], [otlp] or [policy],
the key's name upper-cased:
MMTRACE_TICK_S=0.05, MMTRACE_POLICY_DRY_RUN=true. A value is read by its
key's type: numbers as written in TOML, true/false (or 1/0, yes/no, on/off)
for switches, strings and paths as they are, lists as comma-separated
items (MMTRACE_PIDS=4242,4243; empty: the empty list). The key's rule
then applies as it does to the file, and an error names the variable,
what was expected and what arrived. A variable that starts with MMTRACE_
but names no key is reported, with the nearest name.
"""

import difflib
import re
from dataclasses import fields
from pathlib import Path

from mmtrace.agent.config.settings import (SECTIONS, DaemonConfig, Flag, ListOf, Number, Seconds, _plain, _show, build,
                     build_file, read_document)
from mmtrace.agent.errors import MmtraceError

PREFIX = "MMTRACE_"
_INTEGER = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def variables() -> dict[str, tuple[str | None, str, object]]:
    """Every variable: name -> (section or None, key, the key's rule)."""
    out = {}
    for f in fields(DaemonConfig):
        if f.name not in SECTIONS:
            out[f"{PREFIX}{f.name.upper()}"] = (None, f.name, f.metadata["rule"])
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            out[f"{PREFIX}{section.upper()}_{f.name.upper()}"] = (section, f.name,
                                                                   f.metadata["rule"])
    return out


def _first_key(section: str) -> str:
    return fields(SECTIONS[section])[0].name.upper()


def _typed(rule, text: str):
    """The text as the value the file would hold for `rule`, else None."""
    if isinstance(rule, ListOf):
        items = [item.strip() for item in text.split(",")] if text.strip() else []
        typed = [_typed(rule.item, item) for item in items]
        return None if any(v is None for v in typed) else typed
    if isinstance(rule, Flag):
        word = text.strip().lower()
        return True if word in _TRUE else False if word in _FALSE else None
    if isinstance(rule, (Number, Seconds)):
        text = text.strip()
        try:
            if _INTEGER.fullmatch(text):
                return int(text)        # ValueError past 4300 digits: refused, not raised
            return None if rule.integer else float(text)
        except ValueError:
            return None
    return text


def _expected(rule) -> str:
    if isinstance(rule, ListOf):
        return f"comma-separated items, at most {rule.max_items}, each {rule.item.expected}"
    if isinstance(rule, Flag):
        return "true or false (1/0, yes/no, on/off)"
    return rule.expected


def environment_document(environ) -> tuple[dict, list[str]]:
    """The MMTRACE_* variables of `environ` as a document shaped like the
    file's, and warnings about the variables that name no key; every bad
    value in one MmtraceError."""
    known = variables()
    doc: dict = {}
    problems, warnings = [], []
    for name in sorted(environ):
        if not name.startswith(PREFIX):
            continue
        text = environ[name]
        section = name[len(PREFIX):].lower()
        if section in SECTIONS:
            warnings.append(f"{name} names the section [{section}]; ignored (set its keys "
                            f"as {name}_<KEY>, e.g. {name}_{_first_key(section)})")
            continue
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            warnings.append(f"{name} names no setting; ignored"
                            + (f" (did you mean {near[0]}?)" if near else ""))
            continue
        section, key, rule = known[name]
        typed = _typed(rule, text)
        value = rule.convert(typed) if typed is not None else None
        if value is None:
            problems.append(f"{name}={_show(text)} (expected {_expected(rule)})")
            continue
        (doc.setdefault(section, {}) if section else doc)[key] = _plain(value)
    if problems:
        raise MmtraceError(f"environment: {len(problems)} bad setting"
                           f"{'s' * (len(problems) > 1)}: " + "; ".join(problems))
    return doc, warnings


def load_layers(path: Path | None, environ) -> tuple[DaemonConfig, list[str]]:
    """The defaults, the file's keys over them, the MMTRACE_* variables of
    `environ` over those: (the config, warnings about unknown MMTRACE_*
    variables). Each layer's errors name where they are: the file, or the
    variable."""
    doc = read_document(path) if path is not None else {}
    cfg = build_file(path, doc)         # the file's own errors, named as the file's
    env_doc, warnings = environment_document(environ)
    if not env_doc:
        return cfg, warnings
    merged = {**doc}
    for key, value in env_doc.items():
        if isinstance(value, dict):
            section = merged.get(key)
            merged[key] = {**(section if isinstance(section, dict) else {}), **value}
        else:
            merged[key] = value
    try:
        return build(merged), warnings
    except MmtraceError as exc:         # only what the layers break together is left
        where = f"config {path} with" if path is not None else "the"
        raise MmtraceError(f"{where} MMTRACE_* variables: {exc.message}") from None

