"""A balanced allocator under the live daemon for ten minutes: no memory
alarm may fire. Not part of the test suite (the suite runs the same
scenario for 5 s, tests/test_memory_hangs_bpf.py).

    sudo .venv/bin/python bench/bench_memory_soak.py [--minutes 10]

The allocator (tests/native/device_memory_calls.c `balanced`, over the
stand-in runtime built from the public prototypes: no GPU here) allocates
1 MiB every 10 ms and frees the one before: 100 allocations and 100 frees
a second, holding 1-2 MiB. NVML is the stand-in too (tests/nvml_standin.py):
GPU 0 shows 1 GiB used, steady. The daemon runs with the suite's short
thresholds, which fire on the least growth ([memory] grow_s = 2,
min_growth_mib = 64; [hangs] after_s = 1). Reported: every anomaly about
the allocator or a device, what the daemon held (the metrics), and its RSS
and CPU from /proc. Writes bench/out/memory_soak.json.
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon_process import start_daemon  # noqa: E402
from nvml_standin import FakeGpu, build_standin, standin_env, write_state  # noqa: E402
from test_memory_hangs_bpf import Watch, _free_port, _start, stand_ins  # noqa: E402


def _proc_figures(pid: int) -> tuple[float, float]:
    """(RSS MB, CPU seconds) of a process, from /proc."""
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
               .splitlines() if line.startswith("VmRSS:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return rss / 1024, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None):
    p = argparse.ArgumentParser(prog="bench/bench_memory_soak.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "memory_soak.json")
    args = p.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="mmtrace-memory-soak-"))
    libs, calls = stand_ins(out)
    gpus = out / "gpus"
    write_state(gpus, [FakeGpu("00000000:01:00.0", used_bytes=1 << 30)])
    state, sock, port = out / "state", out / "mmtrace.sock", _free_port()
    config = out / "mmtrace.toml"
    config.write_text(
        f'state_dir = "{state}"\nsocket = "{sock}"\nmetrics_address = "127.0.0.1:{port}"\n'
        f'device_poll_interval_s = 0.5\n'
        f'libs = [{", ".join(json.dumps(str(p)) for p in libs)}]\n'
        '[hangs]\nafter_s = 1.0\ncheck_s = 0.1\n[memory]\ngrow_s = 2.0\nmin_growth_mib = 64\n')
    log: list[str] = []
    daemon = start_daemon(["--config", str(config)], log,
                          env=standin_env(build_standin(out / "nvml"), gpus))
    watch = Watch(sock, port)
    samples = []
    try:
        proc, truth = _start([calls, "balanced", int(args.minutes * 60_000)])
        began = time.monotonic()
        rss0, cpu0 = _proc_figures(daemon.pid)
        while proc.poll() is None:
            watch.poll()
            rss, cpu = _proc_figures(daemon.pid)
            samples.append({"t_s": round(time.monotonic() - began, 1), "rss_mb": round(rss, 1),
                            "cpu_s": round(cpu - cpu0, 2)})
            if len(samples) % 60 == 0:
                print(f"{samples[-1]['t_s']:7.0f} s  daemon RSS {rss:6.1f} MB  "
                      f"anomalies {len(watch.seen)}", flush=True)
            time.sleep(1.0)
        watch.poll()
    finally:
        daemon.send_signal(signal.SIGTERM)
        log += daemon.communicate(timeout=60)[0]
    ours = [a for a in watch.seen.values()
            if a["pid"] == truth["pid"] or a["detector"] in ("memory_leak", "device_hang")]
    seconds = samples[-1]["t_s"] if samples else 0
    summary = {
        "minutes": args.minutes, "allocator_pid": truth["pid"],
        "alarms": [{"detector": a["detector"], "what": a["what"], "pid": a["pid"]}
                   for a in ours],
        "held_bytes_most": watch.most.get(("mmtrace_device_memory_outstanding_bytes",
                                           'device="0",stream="gpu"')),
        "daemon_rss_mb": {"start": round(rss0, 1),
                          "end": samples[-1]["rss_mb"] if samples else None,
                          "most": max((s["rss_mb"] for s in samples), default=None)},
        "daemon_cpu_percent": round(100 * samples[-1]["cpu_s"] / seconds, 2) if seconds else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    print(json.dumps(summary, indent=1))
    return 1 if summary["alarms"] else 0


if __name__ == "__main__":
    sys.exit(main())
