"""`mmtrace record`: drain the probes into a recording file."""

import json
import os
import platform
import signal
import sys
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mmtrace.bpf import counters as bpf_counters
from mmtrace.bpf import device as device_stream
from mmtrace.bpf import sched as sched_stream

from mmtrace.agent import heap
from mmtrace.agent.kernel import probes as probe_loader
from mmtrace.agent.ingest.device_names import DeviceNames
from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.ingest.pipeline import Ingest
from mmtrace.agent.recording.file_format import MAX_META_BYTES, RecordingWriter
from mmtrace.agent.safe_files import UnsafePathError, refuse_unsafe_output
from mmtrace.agent.ingest.threads import ThreadProcesses

# GPU and NPU events share one layout; each event's API says its stream.
SCHEMAS = {"cpu.runq": sched_stream.RUNQ_EVENT, "dev.event": device_stream.DEV_EVENT}
STREAM_SCHEMA = {"cpu": "cpu.runq", "dev": "dev.event"}
CPU_PROBE_STATE = {"stream": "cpu", "program": sched_stream.SOURCE, "state": "attached"}
DEVICE_PROGRAMS = "gpu_npu_programs"
# A reader keeps MAX_META_BYTES of meta, all chunks together, and refuses a
# chunk larger than that: the tables written (probe states, op names, the
# symbol table) stay within this, with room for the rest, whatever the host
# does; what does not fit is counted in the footer (meta_omitted).
META_BUDGET_BYTES = MAX_META_BYTES - (1 << 20)
META_CHUNK_BYTES = 1 << 20      # one table chunk at most
# Probe states may take this much of the budget: files come and go, and
# their states must leave room for the names.
PROBE_META_SHARE = 0.25


def device_programs_failed(error: Exception) -> dict:
    """The probe state of GPU/NPU programs that did not compile or load:
    no library is probed, and the CPU stream goes on."""
    return {"stream": "gpu/npu", "program": DEVICE_PROGRAMS, "state": "failed",
            "point": "load", "reason": str(error)}


@dataclass
class RecordResult:
    events: int
    lost: int
    duration_s: float
    stopped_by: str


class StopFlag:
    """Set by SIGINT / SIGTERM; the loop finishes the file and exits 0."""

    def __init__(self):
        self.reason = None
        self._previous = {}

    def install(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        self.reason = signal.Signals(signum).name

    def __bool__(self):
        return self.reason is not None


class Progress:
    """One line on stderr: rewritten in place on a terminal, else every 10 s.
    When a stream goes live it says so on a line of its own, and the
    progress line names how long each took."""

    def __init__(self, stream=sys.stderr, interval_s: float | None = None):
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = interval_s if interval_s is not None else (1.0 if self.tty else 10.0)
        self._last = 0.0
        self.live_s: dict[str, float] = {}

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval

    def live(self, stream: str, after_s: float, pending: str = ""):
        """`stream` is traced from now on, `after_s` after the start."""
        self.live_s[stream] = after_s
        self.stream.write(f"{stream} stream live ({after_s:.2f} s)"
                          f"{'; ' + pending if pending else ''}\n")
        self.stream.flush()

    def update(self, elapsed: float, events: int, lost: int, force: bool = False):
        if not force and not self.due():
            return
        self._last = time.monotonic()
        line = f"recording {elapsed:7.1f} s  events {events:>12,}  lost {lost:>8,}"
        if self.live_s:
            line += "  live: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.live_s.items())
        if self.tty:
            self.stream.write("\r" + line + ("\n" if force else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


class DeviceSources:
    """The libraries the GPU/NPU probes attach to: --lib paths, and what
    discovery finds while recording (new processes, new files). The first
    scan runs in a thread from creation on, beside the eBPF compilation."""

    def __init__(self, libs=(), pids=(), discover: bool = True, warn=None,
                 interval_s: float = 2.0):
        from mmtrace.agent.kernel.device_probes import wanted
        self.discoverer = None
        self.warn = warn
        self._warned: set[str] = set()
        self.libs = tuple(str(p) for p in libs)
        from mmtrace.agent.discovery import finder as discovery
        if discover:
            try:
                self.discoverer = discovery.Discoverer(wanted, pids=pids or None,
                                                       extra_paths=self.libs,
                                                       interval_s=interval_s)
            except ValueError as exc:
                raise MmtraceError(str(exc)) from None
        self._first: list = []
        self._first_error: BaseException | None = None
        self._scan = threading.Thread(target=self._first_scan, name="mmtrace-discovery",
                                      daemon=True)
        self._scan.start()

    def _first_scan(self):
        try:
            if self.discoverer is None:
                self._first = [device_probe_target(p) for p in self.libs]
            else:
                self._first = self.discoverer.poll()
        except BaseException as exc:    # re-raised in the recording thread
            self._first_error = exc

    def ready(self) -> bool:
        """The first scan is over: targets() will not wait for it."""
        return self._scan is None or not self._scan.is_alive()

    def targets(self) -> list:
        """The first scan's targets (waiting for it), then what is new."""
        if self._scan is not None:
            self._scan.join()
            self._scan = None
            if self._first_error is not None:
                raise self._first_error
            found = self._first
        else:
            found = self.discoverer.poll_if_due() if self.discoverer is not None else []
        self._warn_untraceable()
        return found

    def untraceable(self) -> dict[str, str]:
        """Files running CUDA code that cannot be probed: path -> why."""
        return dict(self.discoverer.untraceable) if self.discoverer is not None else {}

    def known_files(self) -> list[str]:
        """The files handed out for probing now: where a build id is looked up."""
        return [t.path for t in self.discoverer.targets] if self.discoverer is not None \
            else list(self.libs)

    def released(self) -> list:
        """The targets discovery released since the last call (no traced
        process maps them any more): their probes should go."""
        return self.discoverer.take_released() if self.discoverer is not None else []

    def mark_reads_in(self, device) -> None:
        """From now on, each process discovery reads is marked in the
        kernel as it is read (those read before the programs loaded, at
        once): the device program counts the processes that exit unread."""
        if self.discoverer is None or self.discoverer.on_read is not None:
            return
        mark = device.unread_exits()
        if mark is None:
            return
        for pid in self.discoverer.take_read():
            mark(pid)
        self.discoverer.on_read = mark

    def _warn_untraceable(self):
        for path, why in self.untraceable().items():
            if path not in self._warned:
                self._warned.add(path)
                if self.warn is not None:
                    self.warn(f"{path}: {why}")

    def counters(self) -> dict:
        return dict(self.discoverer.counters) if self.discoverer is not None else {}


def device_probe_target(path: str):
    from mmtrace.agent.kernel.device_probes import target_from_path
    try:
        return target_from_path(path)
    except OSError as exc:
        raise MmtraceError(f"--lib {path}: {exc.strerror}") from None


def record(output, duration_s: float | None, pids=(), drain_interval_s: float = 0.025,
           progress: Progress | None = None, stop: StopFlag | None = None,
           options: probe_loader.ProbeOptions | None = None, libs=(),
           discover: bool = True, warn=None, socket_path=None) -> RecordResult:
    """Record every stream to `output`. GPU/NPU probes go on every library
    given in `libs` and, with `discover`, every one found while recording;
    all probes trace (per-launch ones included) unless `options` says not.
    `warn(text)` is told of files that run CUDA code and cannot be traced.
    With `socket_path`, dispatchers' request latencies and entropy samples
    reported on that socket are recorded too (see socket_telemetry)."""
    options = options or probe_loader.ProbeOptions(pids=tuple(pids))
    try:
        refuse_unsafe_output(output)    # said before the probes load; the writer checks again
    except UnsafePathError as exc:
        raise MmtraceError(f"-o {exc}") from None
    began = time.monotonic()
    heap.keep_large_blocks_mapped()
    sources = DeviceSources(libs, options.pids, discover, warn) if options.device else None
    loaded = probe_loader.load_cpu(options)
    if progress:
        progress.live("cpu", time.monotonic() - began,
                      "gpu/npu probes compiling" if options.device else "")
    compiling = DeviceCompile(loaded) if loaded.device_pending else None
    threads = ThreadProcesses()
    own_stop = stop is None
    stop = StopFlag() if own_stop else stop     # an unset flag is falsy: keep it
    if own_stop:
        stop.install()
    writer = telemetry = None
    try:
        if socket_path is not None:
            from mmtrace.agent.socket import telemetry as socket_telemetry
        try:
            writer = RecordingWriter(output, {**SCHEMAS, **(socket_telemetry.SCHEMAS
                                                           if socket_path else {})}, info={
                "hostname": platform.node(),
                "kernel": platform.release(),
                "pids": list(options.pids),
                "recorder_pid": os.getpid(),
            })
        except UnsafePathError as exc:
            raise MmtraceError(f"-o {exc}") from None
        except OSError as exc:
            raise MmtraceError(f"-o {output}: cannot write: {exc.strerror or exc}") from None
        device = _DeviceRecording(loaded, writer, None)
        sink = RecordingSink(writer, device)
        ingest = Ingest(loaded, threads, device.names, [sink])
        if socket_path is not None:
            try:
                telemetry = socket_telemetry.SocketTelemetry(socket_path, writer)
            except OSError as exc:
                raise MmtraceError(f"--socket {socket_path}: {exc}") from None
        start_counters = loaded.counters()
        writer.write_meta({"counters_at_start": start_counters,
                           "apis": device_stream.default_table().to_json(),
                           "probes": [CPU_PROBE_STATE]})
        # The duration counts from when every stream is live; the CPU
        # stream is recorded from its start.
        started = time.monotonic()
        deadline = None
        events = 0
        try:
            while True:
                if compiling is not None and compiling.done() and \
                        (sources is None or sources.ready()):
                    device = sink.device = compiling.wire(writer, sources, warn)
                    ingest.names = device.names
                    compiling = None
                    if progress and device.device is not None:
                        progress.live("gpu/npu", time.monotonic() - began)
                if compiling is None and deadline is None and duration_s:
                    deadline = time.monotonic() + duration_s
                finishing = bool(stop) or (deadline is not None and time.monotonic() >= deadline)
                device.attach()
                events += ingest.drain()
                if telemetry is not None:
                    telemetry.drain()
                # The first progress line once every stream that is coming is live.
                if progress and (finishing or (compiling is None and progress.due())):
                    lost = bpf_counters.total_lost(_delta(loaded.counters(), start_counters))
                    progress.update(time.monotonic() - started, events, lost, force=finishing)
                if finishing:
                    break
                time.sleep(drain_interval_s)
        except OSError:
            if writer.failed is None:
                raise
        end_counters = loaded.counters()
        delta = _delta(end_counters, start_counters)
        lost = bpf_counters.total_lost(delta)
        elapsed = time.monotonic() - started
        footer = {
            "end_monotonic_ns": time.monotonic_ns(),
            "duration_s": elapsed,
            "events": events,
            "counters": delta,
            "lost_events": lost,
            "runq_hist_log2_us": loaded.runq_hist(),
            "unresolved_pids": threads.unresolved,
            "stopped_by": stop.reason or "duration",
            **device.footer(),
            **(telemetry.footer() if telemetry is not None else {}),
        }
        if writer.failed is not None:
            _stop_on_write_error(writer, output, footer)
        writer.close(footer)
        if not writer.still_at_path():
            raise MmtraceError(f"-o {output}: removed or replaced while it was written; the "
                               f"{events:,} events recorded are lost with it")
        return RecordResult(events, lost, elapsed, stop.reason or "duration")
    finally:
        if compiling is not None:
            compiling.thread.join()     # it compiles on the scheduler's maps
        if telemetry is not None:
            telemetry.close()
        if writer is not None and not writer.closed:
            writer.close({"stopped_by": "error"})
        loaded.close()
        if own_stop:
            stop.restore()


class DeviceCompile:
    """The GPU/NPU programs compiling in a thread while the CPU stream is
    drained (bcc releases the GIL while it compiles)."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, name="mmtrace-compile", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.loaded.compile_device()
        except Exception as exc:        # told by the loop, which goes on with the CPU
            self.error = exc

    def done(self) -> bool:
        return not self.thread.is_alive()

    def finish(self) -> Exception | None:
        """Wire the compiled programs (once done); why they are not, or None."""
        if self.error is None:
            try:
                self.loaded.load_device()
            except MmtraceError as exc:
                self.error = exc
        return self.error

    def wire(self, writer, sources, warn=None) -> "_DeviceRecording":
        """The recording's device side once compiled. Where the programs
        failed, the file says so in its probe states (a report then tells
        why it holds no GPU/NPU events) and `warn` is told: the CPU stream
        goes on."""
        error = self.finish()
        if error is None:
            return _DeviceRecording(self.loaded, writer, sources)
        if warn is not None:
            warn(f"GPU/NPU probes unavailable ({error}); recording the CPU stream")
        failed = device_programs_failed(error)
        writer.write_meta({"probes": [failed]})
        return _DeviceRecording(self.loaded, writer, None, failed=failed)


def _stop_on_write_error(writer, output, footer: dict):
    """The disk refused a chunk (full, over quota, failing): end the file
    with its footer where it still fits, else at its last complete chunk,
    and say so in one line."""
    error = writer.failed
    why = error.strerror or str(error)
    try:
        writer.close({**footer, "stopped_by": "write_error", "write_error": why})
        ended = "it ends with its footer"
    except OSError:
        ended = "it ends at its last complete chunk"
    raise MmtraceError(f"{output}: {why} after {writer.events_written:,} events "
                       f"({writer.bytes_written:,} bytes); recording stopped: {ended} and "
                       "reads back") from None


class _DeviceRecording:
    """What the recording keeps of the GPU/NPU side besides its events:
    probe states, the op-name tables, and why names are missing."""

    def __init__(self, loaded, writer, sources, failed: dict | None = None):
        self.loaded = loaded
        self.writer = writer
        self.meta = meta_budget(writer)
        self.failed = failed        # the GPU/NPU programs' state, when they failed
        self.device = loaded.device if failed is None else None
        self.sources = sources if self.device is not None else None
        self.names = DeviceNames(device_stream.default_infos(), resolver=exited_process_resolver(
            loaded, sources.known_files if self.sources is not None else list))
        self._symbols_written = 0

    def attach(self) -> list[dict]:
        """Attach to what the sources found, and release what they no longer
        hold; the states of the new probes (kept in meta chunks of their own)."""
        if self.sources is None:
            return []
        states = attach_and_release(self.device, self.sources, self.names)
        if states:
            self.meta.table("probes", summarised_probe_states(states))
        self._write_symbols()
        return states

    def _write_symbols(self):
        symbols = self.device.symbol_names()
        if len(symbols) != self._symbols_written:
            self.meta.symbols({str(k): v for k, v in symbols.items()})
            self._symbols_written = len(symbols)

    def footer(self) -> dict:
        omitted = {"meta_omitted": dict(self.meta.omitted)} if self.meta.omitted else {}
        if self.failed is not None:
            return {"device_probes": [self.failed], **omitted}
        if self.device is None:
            return omitted
        return {"device_probes": self.device.states(),
                "device_probe_summary": self.device.summary(),
                "name_resolution": self.names.report(),
                "discovery": self.sources.counters(),
                "untraceable_files": self.sources.untraceable(), **omitted}


def attach_and_release(device, sources, names: DeviceNames | None = None) -> list[dict]:
    """Probe the files `sources` found since the last call, release those
    it no longer holds (and the released files kept open past their time),
    and let `names` forget the processes that have exited; the states of
    the new probes."""
    states = [state.as_dict() for state in device.check_rewritten()]
    found = sources.targets()
    sources.mark_reads_in(device)
    for target in found:
        states += [state.as_dict() for state in device.add(target)]
    device.release(sources.released())
    if names is not None:
        names.forget_exited()
    return states


class MetaBudget:
    """The meta tables of one recording, written within META_BUDGET_BYTES
    all together (probe states within PROBE_META_SHARE of it), in chunks
    of at most META_CHUNK_BYTES. A reader keeps only the latest symbol
    table: a new one takes the place of the last. `omitted` counts the
    rows (and symbol tables) left out."""

    def __init__(self, writer, budget: int = META_BUDGET_BYTES):
        self.writer = writer
        self.left = budget
        self.omitted: Counter[str] = Counter()
        self._share_left = {"probes": int(budget * PROBE_META_SHARE)}
        self._symbols_bytes = 0

    def table(self, key: str, rows: list):
        chunk, size = [], 0
        for row in rows:
            cost = _json_size(row) + 2
            if cost > min(self.left, self._share_left.get(key, self.left)):
                self.omitted[key] += 1
                continue
            if key in self._share_left:
                self._share_left[key] -= cost
            if size + cost > META_CHUNK_BYTES and chunk:
                self.writer.write_meta({key: chunk})
                chunk, size = [], 0
            chunk.append(row)
            size += cost
            self.left -= cost
        if chunk:
            self.writer.write_meta({key: chunk})

    def symbols(self, table: dict):
        cost = _json_size(table)
        if cost > self.left + self._symbols_bytes:
            self.omitted["symbol_names"] += 1
            return
        self.left += self._symbols_bytes - cost
        self._symbols_bytes = cost
        self.writer.write_meta({"symbol_names": table})


_budgets: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def meta_budget(writer) -> MetaBudget:
    """The MetaBudget of `writer`, one per recording."""
    budget = _budgets.get(writer)
    if budget is None:
        budget = _budgets[writer] = MetaBudget(writer)
    return budget


def _json_size(value) -> int:
    return len(json.dumps(value, sort_keys=True))


def fit_meta(doc: dict, budget: int = META_BUDGET_BYTES) -> dict:
    """One meta document (a flight recording's) within `budget` bytes of
    JSON: when over, the probe states of symbols their library lacks are
    summarised, one row per library, then the oldest op-name rows dropped,
    and last the probe states counted by state only. `omitted` says what
    was left out."""
    if _json_size(doc) <= budget:
        return doc
    out = {"probes": [], "op_names": [], **doc}
    probes, rows = out["probes"], out["op_names"]
    out["probes"] = summarised_probe_states(probes)
    omitted = {"probe_rows": len(probes) - len(out["probes"])}
    rest = _json_size({k: v for k, v in out.items() if k != "op_names"}) + 256
    out["op_names"] = _newest_within(rows, budget - rest)
    omitted["op_names"] = len(rows) - len(out["op_names"])
    if _json_size(out) > budget:
        out["probes"] = [{"state": state, "count": n} for state, n in sorted(Counter(
            s.get("state", "") for s in probes).items())]
        omitted["probe_rows"] = len(probes)
    out["omitted"] = omitted
    return out


def summarised_probe_states(states: list[dict]) -> list[dict]:
    """The states, with the not_found rows (symbols a library lacks) folded
    into one per library that counts them."""
    out, folded = [], {}
    for state in states:
        if state.get("state") != "not_found":
            out.append(state)
            continue
        key = (state.get("path"), state.get("inode"))
        row = folded.get(key)
        if row is None:
            row = folded[key] = {**state, "symbol": "*", "api": "*", "reason": "",
                                 "count": 0}
            out.append(row)
        row["count"] += int(state.get("count", 1))
    return out


def _newest_within(rows: list, budget: int) -> list:
    """The newest rows whose JSON fits in `budget` bytes."""
    kept, used = 0, 0
    for row in reversed(rows):
        used += _json_size(row) + 2
        if used > budget:
            break
        kept += 1
    return rows[len(rows) - kept:]


def exited_process_resolver(loaded, known_files):
    """An AddressResolver that also names the addresses of processes gone by
    the time their events are read, from the load frames the kernel took."""
    from mmtrace.agent.discovery.process_images import ProcessImages
    from mmtrace.agent.discovery.symbols import AddressResolver
    device = loaded.device
    # The probed files (released ones still open included) reach deleted files too.
    files = device.decoding_files if device is not None else known_files
    return AddressResolver(images=ProcessImages(loaded.bpf, files))


class RecordingSink:
    """The recording's sink of the ingest path: each batch's events in the
    file, the names it made in the op-name tables (of `device`, the
    recording's GPU/NPU side as it is now)."""

    def __init__(self, writer, device):
        self.writer = writer
        self.device = device

    def batch(self, stream, events, op_names):
        if op_names:
            self.device.meta.table("op_names", op_names)
        self.writer.write_events(STREAM_SCHEMA[stream], events)


def _delta(now: dict, start: dict) -> dict:
    return {k: now[k] - start.get(k, 0) for k in now}
