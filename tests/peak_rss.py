"""Peak RSS, CPU and wall time of a command, measured in a process of its
own. A child's ru_maxrss starts from its parent's high-water mark when it
was forked, so the command is started by a small Python process in
between, never straight from a large one (a test runner, a benchmark)."""

import json
import os
import subprocess
import sys
import time

_SPAWN = """
import json, os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = proc.stderr.read()
_, status, usage = os.wait4(proc.pid, 0)
print(json.dumps({"exit": os.waitstatus_to_exitcode(status),
                  "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
                  "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
                  "stderr": err.decode(errors="replace")[-2000:]}))
"""


def measure(args: list[str], env: dict | None = None) -> dict:
    """exit, wall_s, cpu_s, peak_rss_mb and the stderr tail of `args`."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _SPAWN, *map(str, args)], env=env,
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    result["wall_s"] = round(time.monotonic() - started, 2)
    return result


def mmtrace(*args) -> list[str]:
    """The command line running mmtrace with this interpreter."""
    return [sys.executable, "-m", "mmtrace.agent", *map(str, args)]


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1:])))
