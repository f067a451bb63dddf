"""Library churn against the real daemon, measured as an operator would:
descriptors and RssAnon of `mmtrace run` from /proc before, during and
after an unprivileged user loads COPIES distinct copies of a library that
defines cudaLaunchKernel (PARALLEL processes at once, each living LIVE_MS,
each copy deleted after), /metrics and the socket asked every 0.5 s
throughout, and how long SIGTERM takes. Needs root (eBPF, useradd).

    sudo .venv/bin/python bench/bench_library_churn.py               # 2000 16 400, maps only
    sudo CALLS=1 .venv/bin/python bench/bench_library_churn.py 500   # each process calls too
"""

import argparse
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import library_churn  # noqa: E402
from library_churn import open_fds, rss_anon_kib  # noqa: E402

from mmtrace.exporters.terminal.daemon_client import ask  # noqa: E402



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("copies", type=int, nargs="?", default=2000)
    p.add_argument("parallel", type=int, nargs="?", default=16)
    p.add_argument("live_ms", type=int, nargs="?", default=400)
    p.add_argument("--discover-interval", type=float, default=0.2)
    args = p.parse_args()
    calls = os.environ.get("CALLS", "0")
    work = Path(tempfile.mkdtemp(prefix="mmtrace-churn-", dir="/tmp"))
    work.chmod(0o755)
    user = f"mmch{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--no-user-group", "--gid",
                    "nogroup", "--shell", "/usr/sbin/nologin", user], check=True)
    daemon = None
    try:
        churn = library_churn.build(work / "bin")
        copies = work / "copies"
        copies.mkdir()
        shutil.chown(copies, user=user)
        config = library_churn.DAEMON_CONFIG.format(work=work, interval=args.discover_interval)
        (work / "mmtrace.toml").write_text(config)
        log = work / "daemon.log"
        daemon = subprocess.Popen([sys.executable, "-m", "mmtrace.agent", "run", "--config",
                                   str(work / "mmtrace.toml")], stdout=open(log, "w"),
                                  stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while "tracing:" not in log.read_text():
            assert daemon.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        address = re.search(r"metrics on (\S+)/metrics", log.read_text()).group(1)

        def drive(n):
            return subprocess.Popen(["setpriv", f"--reuid={user}", "--regid=nogroup",
                                     "--clear-groups", str(churn.driver), str(churn.library),
                                     str(copies), str(n), str(args.parallel),
                                     str(args.live_ms), calls], stdout=subprocess.PIPE,
                                    text=True)
        drive(50).communicate()             # warm-up: the first probes, the first series
        time.sleep(8)
        start = (open_fds(daemon.pid), rss_anon_kib(daemon.pid))
        began, peak, failures = time.monotonic(), start, {"metrics": 0, "socket": 0}
        run = drive(args.copies)
        while run.poll() is None:
            now = (open_fds(daemon.pid), rss_anon_kib(daemon.pid))
            peak = (max(peak[0], now[0]), max(peak[1], now[1]))
            try:
                urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read()
            except OSError:
                failures["metrics"] += 1
            try:
                ask(work / "s.sock", "status", 5.0)
            except Exception:
                failures["socket"] += 1
            time.sleep(0.5)
        took = time.monotonic() - began
        print(f"{args.copies} copies, {args.parallel} at once, {args.live_ms} ms each, "
              f"calls={calls}: {took:.1f} s; {run.stdout.read().strip().splitlines()[-1]}")
        print(f"fds      start {start[0]:6d}  peak {peak[0]:6d}")
        print(f"RssAnon  start {start[1] / 1024:6.1f}  peak {peak[1] / 1024:6.1f} MB")
        print(f"failed answers during the churn: {failures}")
        waited = 0
        for after in (2, 5, 10, 20):
            time.sleep(after - waited)
            waited = after
            fds, anon = open_fds(daemon.pid), rss_anon_kib(daemon.pid)
            print(f"+{after:2d} s    fds {fds:6d} ({fds / start[0] - 1:+.1%})  RssAnon "
                  f"{anon / 1024:6.1f} MB ({anon / start[1] - 1:+.1%})")
        stopped = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(900)
        print(f"SIGTERM: exit {code} in {time.monotonic() - stopped:.2f} s")
        return 0
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
        subprocess.run(["userdel", user], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
