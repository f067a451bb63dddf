"""`mmtrace explain` as a person reads it: one screen per answer, from the
JSON the diagnosis gives (a recording's, or the daemon's over the socket).
Imports nothing of the agent's, so the live command starts at once."""


def _pct(x) -> str:
    return f"{100 * x:4.0f} %"


def format_text(answer: dict) -> str:
    """One screen: per process its verdict, time split, chain and fixes."""
    lines = []
    window = answer.get("window")
    if window:
        started, ended = window.get("started"), window.get("ended")
        span = (window["end_ns"] - window["start_ns"]) / 1e9
        lines.append(f"window      {started['local'] or '?'} .. {ended['local'] or '?'}  "
                     f"[{window['start_ns'] / 1e9:.3f} .. {window['end_ns'] / 1e9:.3f} s, "
                     f"{span:.1f} s]" if started else
                     f"window      {window['start_ns'] / 1e9:.3f} .. {window['end_ns'] / 1e9:.3f} s")
    ref = answer.get("reference")
    if ref:
        lines.append(f"reference   {ref['start_ns'] / 1e9:.3f} .. {ref['end_ns'] / 1e9:.3f} s "
                     "(what the window is read against)")
    if answer.get("note"):
        lines.append(f"note        {answer['note']}")
    for d in answer.get("devices") or ():
        lines.append("")
        lines.append(f"{d['stream'].upper()} {d['device']}: {d['verdict'].upper()}")
        lines.append(f"  why      {d['line']}")
        for fix in d["fixes"]:
            lines.append(f"  fix      {fix}")
    if not answer["processes"]:
        lines.append("no process made GPU/NPU calls in the window")
    for p in answer["processes"]:
        lines.append("")
        lines.append(f"{p['comm']} (pid {p['pid']}): {p['verdict'].upper()}"
                     + (f"  [{p['failed_calls']:,} failed calls]" if p["failed_calls"] else ""))
        lines.append("  time     " + "  ".join(f"{s} {_pct(v).strip()}"
                                              for s, v in p["shares"].items()))
        if p.get("reference"):
            lines.append("  before   " + "  ".join(f"{s} {_pct(v).strip()}"
                                                  for s, v in p["reference"]["shares"].items()))
        for c in p["causes"]:
            lines.append(f"  cause    {c['verdict']:<13} {_pct(c['share'])}")
        for c in p["culprits"]:
            lines.append(f"  culprit  pid {c['pid']} {c['comm'] or '?'} (tid {c['tid']}) held "
                         f"the CPU for {_pct(c['share']).strip()} of the wait")
        for i, link in enumerate(p["chain"]):
            lines.append(f"  {'why' if i == 0 else '   '}   {'-> ' if i else ''}{link}")
        for fix in p["fixes"]:
            lines.append(f"  fix      {fix}")
        if p.get("timeline") and len({t['verdict'] for t in p["timeline"]}) > 1:
            marks = " ".join(f"{t['start_ns'] / 1e9:.0f}s:{t['verdict']}"
                             for t in p["timeline"])
            lines.append(f"  timeline {marks}")
    return "\n".join(lines)
