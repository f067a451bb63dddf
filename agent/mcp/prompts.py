"""The MCP prompts: investigations an assistant can be started on, each a
walk through the tools in the order the evidence is best read."""

import unicodedata

NAME = "investigate-latency-regression"
DESCRIPTION = "Investigate a latency regression on this host, from mmtrace's own evidence."
ARGUMENTS = [
    ("pid", "The process that got slower, if known."),
    ("when", "When it got slower (wall clock, e.g. 14:02), if known."),
]


MAX_ARGUMENT_CHARS = 100


def clean(value) -> str:
    """A prompt argument as it goes into the text: one short line, without
    control or format characters (a newline would start an instruction of
    its own, a bidi override would show the reader other text than sent)."""
    return "".join(c for c in str(value)
                   if unicodedata.category(c) not in ("Cc", "Cf", "Zl", "Zp"))[:MAX_ARGUMENT_CHARS]


def investigate(pid: str | None = None, when: str | None = None) -> str:
    about = f" of process {pid}" if pid else ""
    at = f", around {when}" if when else ""
    return f"""Latency{about} went up on this host{at}. Find out why from mmtrace's evidence, \
not from guesses, and say which evidence each conclusion rests on.

1. `status`: which processes do GPU/NPU work now, their run-queue and sync-wait p99, \
runnable share against its threshold, failed calls; the active anomalies and hints.
2. `anomalies`: what the detectors fired on, when, with the verdict and the evidence \
(p99 against baseline, share against threshold, culprits).
3. `explain` with the pid{f' {pid}' if pid else ' of each process named above'}: where \
its launching threads' time went, the verdict, who held the CPU, the chain and the fix. \
Use `series` (e.g. runq_delay{{pid=P}}) to put numbers on the rise over 10 s and 60 s.
4. `recordings`: the flight recording written when the anomaly fired{at}; `explain` it \
with `path` (its timeline shows when the verdict changed) and `report` it for the whole \
picture. If none covers the moment and the problem is still on, `dump` writes one \
(only when the server allows it).

Answer with: the verdict, the chain from symptom to cause with the figures, the culprits, \
the fix mmtrace proposes, and what remains uncertain."""
