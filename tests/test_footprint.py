"""The daemon's footprint: rings sized by the rate they absorb, a loop that
sleeps until there is work, the compiler's leftovers out of the steady
state, the CPU stream live before the GPU/NPU programs compile, and no
SDK imported for a feature that is off."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mmtrace.agent.kernel import compiler_memory
from mmtrace.agent.ingest.event_ring import EventRing
from mmtrace.agent.kernel.probes import wakeup_period
from mmtrace.agent.ingest.wakeups import Waiter
from mmtrace.bpf.sched import RUNQ_EVENT


def runq_batch(first_ts_ns: int, n: int, step_ns: int) -> np.ndarray:
    batch = np.zeros(n, RUNQ_EVENT)
    batch["ts_ns"] = first_ts_ns + step_ns * np.arange(n)
    batch["tid"] = np.arange(n)
    return batch


def test_ring_grows_to_what_its_age_holds_at_the_rate_and_stays_there():
    # 10 s of reach; 1000 records a second arrive in batches of 100.
    ring = EventRing(RUNQ_EVENT, capacity=1 << 20, max_age_ns=10 * 10**9, initial=64)
    sizes = []
    for i in range(300):                            # 30 s
        ring.push(runq_batch(i * 10**8, 100, 10**6))
        sizes.append(ring.allocated)
    assert sizes[0] == 125                          # the first batch and a quarter more
    assert 10_001 <= ring.allocated <= 1.25 * 10_100 + 1    # the 10 s it holds, + 25 % at most
    assert len(sizes) - sizes.index(sizes[-1]) > 150   # flat for the last 15 s at least
    assert len(ring) == 10_001                      # 19.999 s .. 29.999 s, 1 ms apart
    held = ring.window()
    assert np.all(np.diff(held["ts_ns"].astype(np.int64)) == 10**6)   # in order, none lost
    assert int(held["ts_ns"][-1]) == 299 * 10**8 + 99 * 10**6


def test_ring_never_grows_past_its_capacity_and_keeps_record_numbers():
    ring = EventRing(RUNQ_EVENT, capacity=1000, max_age_ns=10**15, initial=16)
    first = ring.push(runq_batch(0, 10, 1))
    ring.push(runq_batch(10, 2000, 1))
    assert ring.allocated == 1000 and len(ring) == 1000 and ring.evicted == 1010
    seqs = np.arange(ring.end - 5, ring.end)
    ring.update(seqs, "delay_ns", np.full(5, 7, np.uint64))
    assert list(ring.window()["delay_ns"][-6:]) == [0, 7, 7, 7, 7, 7]
    assert first == 0 and ring.end == 2010


def test_ring_growth_keeps_held_records_where_their_numbers_say():
    ring = EventRing(RUNQ_EVENT, capacity=1 << 12, max_age_ns=3, initial=4)
    ring.push(runq_batch(0, 3, 1))                  # ts 0..2
    ring.push(runq_batch(3, 3, 1))                  # ts 3..5: 2..5 kept, wrapped in 4
    assert (ring.allocated, ring.start, ring.end) == (4, 2, 6)
    ring.push(runq_batch(6, 6, 0))                  # six at ts 6: 3..6 kept, 9 records
    assert ring.allocated == 11                     # 9 and a quarter more
    assert list(ring.window()["ts_ns"]) == [3, 4, 5] + [6] * 6
    ring.update(np.array([3, 11]), "delay_ns", np.array([5, 6], np.uint64))
    assert list(ring.window()["delay_ns"][[0, 8]]) == [5, 6]


def test_waiter_sleeps_until_a_descriptor_is_ready_or_the_deadline():
    waiter = Waiter()
    r, w = os.pipe()
    try:
        waiter.watch(r)
        t = time.monotonic()
        assert not waiter.wait(0.2)
        assert time.monotonic() - t >= 0.15
        os.write(w, b"x")
        t = time.monotonic()
        assert waiter.wait(5.0)
        assert time.monotonic() - t < 1.0
        assert (waiter.wakeups, waiter.data_wakeups) == (2, 1)
    finally:
        waiter.close()
        os.close(r)
        os.close(w)


def test_edge_watched_descriptor_wakes_once_per_signal_not_while_it_holds_data():
    waiter = Waiter()
    r, w = os.pipe()
    try:
        waiter.watch(r, edge=True)
        os.write(w, b"x")
        assert waiter.wait(1.0)
        assert not waiter.wait(0.05)        # still readable, but nothing new was signalled
        os.write(w, b"y")
        assert waiter.wait(1.0)
    finally:
        waiter.close()
        os.close(r)
        os.close(w)


SMAPS = """\
7f0000000000-7f0000100000 r--p 00000000 08:01 11 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
Rss:                1024 kB
Anonymous:             0 kB
7f0000100000-7f0000200000 r-xp 00100000 08:01 11 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
Rss:                 512 kB
Anonymous:             0 kB
7f0000200000-7f0000300000 r--p 00200000 08:01 11 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
Rss:                 256 kB
Anonymous:           256 kB
7f0000300000-7f0000310000 rw-p 00300000 08:01 11 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
Rss:                  64 kB
Anonymous:             0 kB
7f0000400000-7f0000500000 r-xp 00000000 08:01 12 /usr/lib/llvm-14/lib/libclang-cpp.so.14
Rss:                 128 kB
Anonymous:             0 kB
7f0000500000-7f0000600000 r-xp 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/libbcc.so.0.26.0
Rss:                 128 kB
Anonymous:             0 kB
7f0000600000-7f0000700000 rw-p 00000000 00:00 0
Rss:                 999 kB
Anonymous:           999 kB
"""


def test_only_the_compilers_clean_read_only_pages_are_dropped():
    maps = compiler_memory.mappings(SMAPS)
    assert [(m.rss_kb, m.anonymous_kb) for m in maps][:3] == [(1024, 0), (512, 0), (256, 256)]
    dropped = [(m.start, m.perms) for m in maps if compiler_memory.droppable(m)]
    # Relocated (copied) data, writable data, bcc itself and the heap stay.
    assert dropped == [(0x7f0000000000, "r--p"), (0x7f0000100000, "r-xp"),
                       (0x7f0000400000, "r-xp")]


def test_release_unmaps_the_compilers_pages_of_this_process():
    pytest.importorskip("bcc")
    if not any(re.search(r"libLLVM|libclang", line)
               for line in open("/proc/self/maps")):
        pytest.skip("bcc's LLVM is not mapped into this process")
    text = open("/proc/self/smaps").read()
    held = sum(m.rss_kb for m in compiler_memory.mappings(text) if compiler_memory.droppable(m))
    compiler_memory.release()
    after = sum(m.rss_kb for m in compiler_memory.mappings(open("/proc/self/smaps").read())
                if compiler_memory.droppable(m))
    assert after <= held // 4 + 64


def test_wakeup_period_keeps_a_ring_a_quarter_full_at_most():
    # 4 MiB of 56-byte records (48 + the ring's 8-byte header) over 2 CPUs.
    assert wakeup_period(1024, 48, cpus=2) == 4 * 2**20 // 56 // 8
    assert wakeup_period(1024, 48, cpus=128) * 128 * 56 <= 2**20
    assert wakeup_period(1, 224, cpus=4096) == 1


# ------------------------------------------------------------ the real daemon

DAEMON_MODULES = r"""
import atexit, sys
atexit.register(lambda: print("modules:", " ".join(sorted({m.split(".")[0]
                for m in sys.modules})), file=sys.stderr, flush=True))
from mmtrace.agent.cli import main
sys.argv[0] = "mmtrace"
main()
"""


def proc_status(pid: int, task: int | None = None) -> dict[str, int]:
    path = f"/proc/{pid}/task/{task}/status" if task else f"/proc/{pid}/status"
    text = open(path).read()
    return {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+)", text, re.M)}


def read_until(proc, pattern: str, lines: list[str], timeout_s: float) -> float:
    """Seconds until a line matching `pattern` arrived (lines kept)."""
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        line = proc.stderr.readline()
        assert line, "exited: " + "".join(lines)
        lines.append(line)
        if re.search(pattern, line):
            return time.monotonic() - t
    raise AssertionError(f"no {pattern!r} within {timeout_s} s: " + "".join(lines))


@pytest.mark.bpf
def test_daemon_cpu_stream_live_soon_idle_wakeups_few_no_sdk_imported(tmp_path):
    launched = time.monotonic()
    daemon = subprocess.Popen(
        [sys.executable, "-c", DAEMON_MODULES, "run", "--state-dir", tmp_path / "state",
         "--socket", tmp_path / "hint.sock", "--metrics-address", "127.0.0.1:0"],
        stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        read_until(daemon, r"cpu stream live", lines, 60)
        cpu_live = time.monotonic() - launched
        read_until(daemon, r"tracing:", lines, 120)
        text = "".join(lines)
        assert text.index("cpu stream live") < text.index("tracing:")
        # The loop's own thread: one voluntary switch per sleep; it polled
        # 40 times a second before it slept on its descriptors.
        before = proc_status(daemon.pid, daemon.pid)["voluntary_ctxt_switches"]
        time.sleep(3.0)
        after = proc_status(daemon.pid, daemon.pid)["voluntary_ctxt_switches"]
        rss_kb = proc_status(daemon.pid)["VmRSS"]
    finally:
        daemon.send_signal(signal.SIGTERM)
        _, rest = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, "".join(lines) + rest
    assert cpu_live < 3.0, "".join(lines)     # imports and the scheduler program: ~1 s idle, 3.5 s before
    assert (after - before) / 3.0 < 20, (before, after)
    assert rss_kb < 220 * 1024, rss_kb      # 365 MB when the rings were sized for the worst case
    modules = set(re.search(r"^modules: (.*)$", rest, re.M).group(1).split())
    # Nor the in-server dispatcher (asyncio with it): only the hint policy.
    unwanted = {"torch", "opentelemetry", "asyncio"}
    assert not modules & unwanted, sorted(modules & unwanted)


@pytest.mark.bpf
def test_record_says_when_each_stream_is_live(tmp_path):
    out = tmp_path / "r.mmtr"
    rec = subprocess.Popen([sys.executable, "-m", "mmtrace.agent", "record", "-o", str(out),
                            "--duration", "1"], stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        first = read_until(rec, r"stream live", lines, 60)
        read_until(rec, r"^recording ", lines, 120)
    finally:
        _, rest = rec.communicate(timeout=120)
    assert rec.returncode == 0, "".join(lines) + rest
    assert re.match(r"cpu stream live \(\d+\.\d\d s\); gpu/npu probes compiling$", lines[0]), lines
    # ...and how the launches' return codes are probed (this kernel has uprobe sessions)
    assert any(re.match(r"gpu/npu stream live \(\d+\.\d\d s\); per-launch return codes: 1 call "
                        r"in 64 per CPU, and every call of a process whose calls failed in the "
                        r"last second$", line) for line in lines), lines
    assert re.search(r"live: cpu \d+\.\d\d s, gpu/npu \d+\.\d\d s", lines[-1]), lines
    assert first < 4.0


def epoll_fds() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventpoll]"
               for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))


def test_a_closed_waiter_holds_no_descriptor_and_can_be_used_again():
    before = epoll_fds()
    r, w = os.pipe()
    try:
        waiter = Waiter()
        waiter.watch(r)
        assert epoll_fds() == before + 1
        waiter.close()
        assert epoll_fds() == before
        waiter.watch(r)                         # a restarted loop opens it again
        os.write(w, b"x")
        assert waiter.wait(1.0)
        waiter.close()
        assert epoll_fds() == before
    finally:
        os.close(r), os.close(w)
