"""`mmtrace top`: the running daemon's live state in a terminal.

It asks the daemon over the hint socket (`{"v": 1, "type": "status"}`),
redraws once a second with plain ANSI (clear, home), and reads single keys
in cbreak mode, so it works over ssh in any terminal; `q` quits. Imports
nothing of the agent's: it is a client like a dispatcher."""

import os
import select
import sys
import termios
import time
import tty
from pathlib import Path

from mmtrace.exporters.terminal.daemon_client import NoDaemon, ask  # noqa: F401  (NoDaemon: callers catch it here)

CLEAR = "\x1b[H\x1b[2J"


def fetch_status(path: Path, timeout_s: float = 2.0) -> dict:
    """One status snapshot; NoDaemon when nobody listens, ValueError when
    what answers does not speak the protocol."""
    return ask(path, "status", timeout_s)


MAX_FAILURE_LINES = 8


def render(status: dict, width: int = 100, live: bool = False) -> list[str]:
    """The screen, as lines: processes, then anomalies and hints, then
    losses; `live` (the refreshing view) says how to quit."""
    up = status.get("uptime_s", 0.0)
    lines = [f"mmtrace top — daemon pid {status.get('daemon_pid')}, up {_duration(up)}, "
             f"last {status.get('span_s', 0):g} s, per-launch probes "
             f"{status.get('launch_probes', '?')}" + ("   (q quits)" if live else ""), ""]
    # One unit per column, named in its header; "off" where a figure is not measured.
    # Failed calls did no work: they are in FAILED/s and below, not in the others.
    # RUNNABLE %: the share of the launching threads' time spent waiting on a
    # run queue in the latest window, over the starvation detector's threshold.
    lines.append(f"{'PID':>8} {'PROCESS':<16} {'RUNQ p99 ms':>12} {'RUNNABLE %':>10} "
                 f"{'LAUNCH/s':>10} {'SYNC p99 ms':>12} {'MEMCPY GB/s':>12} {'FAILED/s':>10}")
    processes = status.get("processes") or []
    failing = []
    for p in processes:
        runq_us = p.get("runq_p99_us")
        launches = p.get("launches_per_s")
        lines.append(f"{p['pid']:>8} {(p.get('comm') or '?')[:16]:<16} "
                     f"{_ms(None if runq_us is None else runq_us / 1e3):>12} "
                     f"{_runnable(p):>10} "
                     f"{'off' if launches is None else f'{launches:.1f}':>10} "
                     f"{_ms(p.get('sync_wait_p99_ms')):>12} "
                     f"{p.get('memcpy_gb_per_s', 0):>12.2f} "
                     f"{p.get('failed_per_s', 0):>10.1f}")
        failing += [(p["pid"], f) for f in p.get("failed_calls") or []]
    if not processes:
        lines.append("   (no process did GPU/NPU work in this span)")
    if failing:
        lines += ["", f"FAILED CALLS (last {status.get('span_s', 0):g} s)"]
        lines += [f"{pid:>8} {f.get('api', '?'):<28} {f.get('error', '?'):<44} "
                  f"{f.get('count', 0):>9,}" for pid, f in failing[:MAX_FAILURE_LINES]]
    lines += ["", "ANOMALIES"]
    for a in status.get("anomalies") or []:
        ratio = (f"  p99 {a['p99'] * 1e3:.2f} ms vs baseline {a['baseline'] * 1e3:.2f} ms"
                 if a.get("p99") is not None and a.get("baseline") else "")
        if a.get("share") is not None and a.get("threshold") is not None:
            ratio += (f"  {(a.get('part') or 'runnable').replace('_', '-')} {_pct(a['share'])} "
                      f"vs threshold {_pct(a['threshold'])}")
        where = f" [{a['modality']}]" if a.get("modality") else ""
        if a.get("pid") is not None and f"pid={a['pid']}" not in str(a.get("what")):
            # a detector's kind (starvation's cpu_starved) names no process: say which
            where += f" pid {a['pid']}" + (f" ({a['comm']})" if a.get("comm") else "")
        verdict = f"  verdict {a['verdict']}" if a.get("verdict") else ""
        lines.append(f"  {a.get('state', '?'):<8} {a.get('detector')} {a.get('what')}{where}"
                     f"{ratio}{verdict}")
    if not status.get("anomalies"):
        lines.append("  none")
    lines += ["", f"HINTS ({status.get('hints_sent', 0)} sent)"]
    for h in status.get("hints") or []:
        lines.append(f"  {h.get('kind')} {h.get('target')} value={h.get('value')} "
                     f"ttl={h.get('ttl_s')}s  {h.get('reason', '')}")
    if not status.get("hints"):
        lines.append("  none")
    losses = status.get("losses") or {}
    lines += ["", "LOSSES  " + ("  ".join(f"{k}={v}" for k, v in sorted(losses.items()))
                                or "none")]
    return [line[:width] for line in lines]


def run(path: Path, interval_s: float = 1.0, out=sys.stdout, keys=sys.stdin) -> None:
    """Redraw every interval until `q` (or Ctrl-C). Raises NoDaemon when
    the daemon is not there at the start; later it says so on the screen
    and keeps trying, as top does for a process that went away."""
    status = fetch_status(path)
    interactive = keys.isatty()
    saved = termios.tcgetattr(keys) if interactive else None
    try:
        if interactive:
            tty.setcbreak(keys.fileno())
        while True:
            width = _width(out)
            out.write(CLEAR + "\n".join(render(status, width, live=True)) + "\n")
            out.flush()
            if _quit_within(keys, interval_s):
                return
            try:
                status = fetch_status(path)
            except (NoDaemon, ValueError) as exc:
                status = {"daemon_pid": None, "launch_probes": "?",
                          "losses": {}, "anomalies": [{"state": "lost", "detector": "top",
                                                       "what": str(exc)}]}
    except KeyboardInterrupt:
        return
    finally:
        if saved is not None:
            termios.tcsetattr(keys, termios.TCSADRAIN, saved)


def _quit_within(keys, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([keys], [], [], left)
        if not ready:
            return False
        got = os.read(keys.fileno(), 64)
        if not got or b"q" in got or b"Q" in got:
            return True
    return False


def _width(out) -> int:
    try:
        return os.get_terminal_size(out.fileno()).columns or 120   # 0: a pty never sized
    except (OSError, ValueError, AttributeError):
        return 120


def _runnable(p: dict) -> str:
    """"46/10": the runnable share and the starvation threshold, in percent;
    "off" where the launchers' time is not measured."""
    share, threshold = p.get("runnable_share"), p.get("runnable_threshold")
    if share is None:
        return "off"
    return f"{share * 100:.0f}" + ("" if threshold is None else f"/{threshold * 100:.0f}")


def _pct(share: float) -> str:
    return f"{share * 100:.0f} %"


def _ms(value) -> str:
    """Milliseconds, to the microsecond; "—" when no event made the figure."""
    return "—" if value is None else f"{value:.3f}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"
