"""The `mmtrace` command line."""

import os

# mmtrace does no linear algebra: numpy's OpenBLAS need not start a thread
# per CPU when it is imported, which cost a command 0.09 CPU-seconds here
# (a fifteenth of a report on a 265 MiB recording). Set before anything
# imports numpy; a user's own setting is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json
import sys
from dataclasses import dataclass

import click

from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.priority import DEFAULT_NICE, set_niceness


@dataclass
class Context:
    """Shared by every command (click's context object)."""
    verbose: bool = False


def _open(path):
    """The recording, opened for streaming (its warnings said once); the
    process's malloc set to reuse one batch's blocks for the next."""
    from mmtrace.agent import heap
    from mmtrace.agent.recording.file_format import RecordingError, RecordingReader
    heap.reuse_freed_blocks()
    try:
        rec = RecordingReader(path)
    except RecordingError as exc:
        raise MmtraceError(str(exc)) from None
    for warning in rec.warnings:
        click.echo(f"mmtrace: warning: {warning}", err=True)
    return rec


def _streamed(rec, work):
    """Run `work(rec)`, with a file that changes while being read reported
    as one line."""
    from mmtrace.agent.recording.file_format import RecordingError
    try:
        with rec:
            return work(rec)
    except RecordingError as exc:
        raise MmtraceError(str(exc)) from None


class OneLineError(click.ClickException):
    """What the CLI makes of a library's MmtraceError: one line, exit 2."""

    exit_code = 2

    def show(self, file=None):
        click.echo(f"mmtrace: error: {self.format_message()}", err=True, file=file)


class Commands(click.Group):
    """mmtrace's commands: an MmtraceError from any of them (the library's
    plain exception) ends it as one line and exit status 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MmtraceError as exc:
            raise OneLineError(exc.message) from None


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log more on stderr.")
@click.version_option(package_name="mmtrace")
@click.pass_context
def cli(ctx, verbose):
    """eBPF tracing and anomaly detection for multimodal inference hosts.

    \b
    Start with:
      sudo mmtrace doctor                 what works on this host
      sudo mmtrace record -o incident.mmtr --duration 30
      mmtrace report incident.mmtr        what happened
      mmtrace export incident.mmtr --format chrome -o incident.json
    """
    ctx.obj = Context(verbose=verbose)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def doctor(as_json):
    """Check what tracing needs on this host, and how to fix what is missing.

    Exit status 0 when tracing can run, 1 when it cannot.

    \b
    Example:
      sudo mmtrace doctor
      sudo mmtrace doctor --json | jq '.checks[] | select(.ok | not)'
    """
    from mmtrace.agent.doctor import host as doctor_checks
    results = doctor_checks.run_checks(compile_apart=True)    # this process's only load
    ready = doctor_checks.tracing_ready(results)
    if as_json:
        click.echo(json.dumps({"ready": ready, "checks": [r.as_dict() for r in results]},
                              indent=2))
    else:
        click.echo(doctor_checks.format_text(results, ready))
    sys.exit(0 if ready else 1)


class Seconds(click.ParamType):
    """A duration flag, checked as every duration from outside is
    (mmtrace.dispatch.durations): NaN, inf, 0 and the out-of-range refused."""
    name = "seconds"

    def __init__(self, low: float, high: float):
        self.low, self.high = low, high

    def convert(self, value, param, ctx):
        from mmtrace.dispatch.durations import expected_duration, is_duration
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not is_duration(number, self.low, self.high):
            self.fail(f"expected {expected_duration(self.low, self.high)}, got {value!r}",
                      param, ctx)
        return number


@cli.command()
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, writable=True),
              help="Recording file to write.")
@click.option("--duration", type=Seconds(0.001, 7 * 86400), default=None,
              help="Seconds to record, from when the CPU stream is live (the GPU/NPU "
                   "streams join about a second later, and a shorter recording lasts "
                   "until they have); default: until Ctrl-C or SIGTERM.")
@click.option("--pid", "pids", type=click.IntRange(min=1), multiple=True,
              help="Only these processes (all their threads); repeatable.")
@click.option("--lib", "libs", type=click.Path(exists=True, dir_okay=False), multiple=True,
              help="Also probe this library or executable; repeatable.")
@click.option("--nice", type=click.IntRange(-20, 19), default=DEFAULT_NICE, show_default=True,
              help="The recorder's niceness: it must keep draining while the CPUs it "
                   "watches are contended.")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False), default=None,
              help="Also listen here for the request latencies and entropy samples that "
                   "dispatchers report (the daemon's hint socket protocol); default: off. "
                   "Give the daemon's path, /run/mmtrace/mmtrace.sock, while no daemon runs.")
@click.option("--launch-return-every", type=click.IntRange(0, 1 << 20), default=64,
              show_default=True,
              help="Kernel launches whose return code is probed: 1 in N on each CPU, each "
                   "process's first, and every one of a process whose calls failed in the "
                   "last second; 1: every launch (about 0.4 µs more each); 0: none. Copies, "
                   "syncs and graph launches always have theirs.")
@click.option("--device-ringbuf-mib", type=click.IntRange(1, 1024), default=8,
              show_default=True,
              help="The kernel's GPU/NPU call ring, in MiB (a power of two), and its launch "
                   "ring at half of it: 8 holds a burst of 55 000 launches back to back whole "
                   "on either; the recorder drains them at once from 1/16 full. Kernel memory, "
                   "mapped here.")
def record(output, duration, pids, libs, nice, socket_path, launch_return_every,
           device_ringbuf_mib):
    """Record the CPU, GPU and NPU streams to a file for later analysis.

    A progress line on stderr shows elapsed time, events and losses.
    Ctrl-C or SIGTERM closes the file cleanly (exit 0). Needs root.

    GPU/NPU probes attach to every CUDA / Ascend library found in running
    processes, the usual install paths and Python site-packages, and to
    each --lib; every kernel launch is traced (each costs about 0.4 µs
    beyond the kernel's uprobe trap; BENCHMARKS.md has the figures).
    A call that returns an error is counted apart, per API and code, not
    as work.

    \b
    Examples:
      sudo mmtrace record -o incident.mmtr --duration 30
      sudo mmtrace record -o server.mmtr --pid 4242 --pid 4243
      sudo mmtrace record -o app.mmtr --lib /opt/app/bin/server   # static cudart
      sudo mmtrace record -o loop.mmtr --socket /run/mmtrace/mmtrace.sock
    """
    import os
    from mmtrace.agent.recording import recorder
    for pid in pids:
        if not os.path.exists(f"/proc/{pid}"):
            raise MmtraceError(f"--pid {pid}: no such process")
    if device_ringbuf_mib & (device_ringbuf_mib - 1):
        raise MmtraceError(f"--device-ringbuf-mib {device_ringbuf_mib}: expected a power of two "
                           "(1, 2, 4, ... 1024)")
    from mmtrace.agent.kernel.probes import require_privileges
    require_privileges()        # the one clear line comes before any warning
    why_not = set_niceness(nice)
    if why_not:
        click.echo(f"mmtrace: warning: {why_not}", err=True)
    from mmtrace.agent.kernel.probes import ProbeOptions
    result = recorder.record(output, duration, pids=pids, libs=libs,
                             options=ProbeOptions(pids=tuple(pids),
                                                  launch_return_every=launch_return_every,
                                                  dev_ringbuf_pages=device_ringbuf_mib * 256),
                             progress=recorder.Progress(), socket_path=socket_path,
                             compile_apart=True,      # this process's only load
                             warn=lambda text: click.echo(f"mmtrace: warning: {text}",
                                                          err=True))
    lost = f" ({result.lost_by})" if result.lost else ""
    click.echo(f"wrote {output}: {result.events:,} events, {result.lost:,} lost{lost}, "
               f"{result.duration_s:.1f} s", err=True)


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def report(file, as_json):
    """Summarise a recording: events, losses, run-queue delay, top ops, anomalies.

    \b
    Examples:
      mmtrace report incident.mmtr
      mmtrace report incident.mmtr --json | jq .runq.p99_us
    """
    from mmtrace.agent.recording.report import format_text, summarize
    summary = _streamed(_open(file), summarize)
    click.echo(json.dumps(summary, indent=2) if as_json else format_text(summary))


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", required=True,
              type=click.Choice(["jsonl", "perfetto", "chrome"]),
              help="jsonl: one event per line; perfetto: a native Perfetto trace; "
                   "chrome: trace-event JSON (Perfetto UI and chrome://tracing).")
@click.option("-o", "--output", required=True,
              help="File to write, or - for standard output (jsonl only).")
def export(file, fmt, output):
    """Convert a recording to JSON Lines or a trace for Perfetto.

    The recording is read a piece at a time, in memory that does not grow
    with it. The output appears only once complete (it is written beside
    its place, then renamed), and never replaces the recording itself.

    \b
    Examples:
      mmtrace export incident.mmtr --format jsonl -o - | head
      mmtrace export incident.mmtr --format perfetto -o incident.pftrace
      mmtrace export incident.mmtr --format chrome -o incident.json
    """
    from mmtrace.agent.recording.export_output import ExportOutput, OutputError
    from mmtrace.agent.recording.replay import replay
    if output == "-" and fmt != "jsonl":
        raise MmtraceError(f"-o - writes jsonl only; --format {fmt} needs a file")
    unit = "slices" if fmt == "perfetto" else "events"
    with _open(file) as rec:
        write = _writer(fmt, rec)
        try:
            with ExportOutput(output, source=file) as out:
                n = _streamed(rec, lambda r: write(replay(r), out.stream))
        except OutputError as exc:
            raise MmtraceError(str(exc)) from None
    if output != "-":
        click.echo(f"wrote {output}: {n:,} {unit}", err=True)


def _writer(fmt, rec):
    if fmt == "jsonl":
        from mmtrace.exporters.files.jsonl import write_jsonl
        return write_jsonl
    if fmt == "chrome":
        from mmtrace.exporters.files.chrome import write_chrome
        return write_chrome
    from functools import partial

    from mmtrace.agent.recording.offline_detectors import Detectors
    from mmtrace.exporters.files.perfetto import write_recording
    # its anomalies too: those recorded, and those the detectors find over it
    return partial(write_recording, source=rec, detectors=Detectors(rec))


@cli.command()
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False),
              help="TOML configuration (see systemd/mmtrace.toml); MMTRACE_* variables "
                   "and flags override it.")
@click.option("--pid", "pids", type=click.IntRange(min=1), multiple=True,
              help="Only these processes (all their threads); repeatable.")
@click.option("--lib", "libs", type=click.Path(exists=True, dir_okay=False), multiple=True,
              help="Also probe this library or executable; repeatable.")
@click.option("--state-dir", type=click.Path(file_okay=False),
              help="Where flight recordings go (default /var/lib/mmtrace).")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False),
              help="Hint socket path (default /run/mmtrace/mmtrace.sock).")
@click.option("--trace-launches/--adaptive-launches", default=None,
              help="Trace every kernel launch, or (default) only for a while after an alarm.")
@click.option("--metrics-address", metavar="HOST:PORT",
              help="Prometheus endpoint (default :9464; off: none).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
@click.option("--check", is_flag=True,
              help="Load the configuration, attach everything, report what attached and "
                   "what did not, and exit: 0 when the daemon can start, 1 when it cannot "
                   "(one line says why), 2 for a bad configuration. A running daemon's "
                   "socket and port are left alone.")
def run(config_path, pids, libs, state_dir, socket_path, trace_launches, metrics_address,
        log_level, check):
    """Run the per-node daemon in the foreground (systemd runs this).

    Traces the CPU, GPU and NPU streams, watches P99 drift of run-queue
    delay, sync waits, submit-to-retire latency and the request latencies
    and attention entropy that dispatchers report on the hint socket. When
    an anomaly fires it writes the last 30 s to a flight recording in the
    state directory, and turns per-launch probes on for a while. Needs root
    (or the capabilities in systemd/mmtrace.service). Metrics for Prometheus
    are served on :9464/metrics (see dashboards/ for Grafana and alert rules).

    \b
    Settings, each layer over the one before:
      built-in defaults < --config FILE < MMTRACE_* variables < flags
    MMTRACE_<KEY> sets a top-level key of the file, MMTRACE_<SECTION>_<KEY>
    a key of [p99], [entropy], [failures], [diagnosis], [otlp] or [policy]
  (names upper-cased).
    Values are read by the key's type: numbers, true/false (1/0, yes/no,
    on/off), strings and paths as they are, lists comma-separated. A bad
    value names its variable; a MMTRACE_* variable that names no key is
    logged as a warning.

    \b
    Signals:
      SIGTERM, SIGINT  stop: detach, flush, exit 0 (forced exit 1 after 10 s)
      SIGHUP           read the settings again (what can change live does;
                       a broken file or variable changes nothing)
      SIGUSR2          write the flight recorder's ring now (mmtrace dump)
    Logs go to stderr; under systemd each line carries its syslog priority
    (<N>), so journalctl -p filters them.

    \b
    Examples:
      sudo mmtrace run
      sudo mmtrace run --config /etc/mmtrace/mmtrace.toml
      sudo mmtrace run --check --config /etc/mmtrace/mmtrace.toml
      sudo env MMTRACE_TICK_S=0.05 MMTRACE_POLICY_DRY_RUN=true mmtrace run
      sudo mmtrace run --pid 4242 --state-dir /tmp/mmtrace --trace-launches
      sudo mmtrace run --metrics-address 127.0.0.1:9464
    """
    import logging
    from pathlib import Path
    from mmtrace.agent.daemon import log_format
    log_format.configure(log_level)
    log = logging.getLogger("mmtrace.daemon")
    path = Path(config_path) if config_path else None
    flags = _RunFlags(pids, libs, state_dir, socket_path, trace_launches, metrics_address)

    def configuration():
        cfg, warnings = _run_settings(path, flags)
        for warning in warnings:
            log.warning(warning)
        return cfg

    if check:
        _check(*_run_settings(path, flags), path)
        return
    _run_daemon(configuration(), configuration, log)


@dataclass(frozen=True)
class _RunFlags:
    """The flags of `run` that override the settings (empty or None: not given)."""
    pids: tuple
    libs: tuple
    state_dir: str | None
    socket_path: str | None
    trace_launches: bool | None
    metrics_address: str | None

    def apply(self, cfg):
        from pathlib import Path
        if self.pids:
            cfg.pids = tuple(self.pids)
        if self.libs:
            cfg.libs = tuple(self.libs)
        if self.state_dir:
            cfg.state_dir = Path(self.state_dir)
        if self.socket_path:
            cfg.socket = Path(self.socket_path)
        if self.trace_launches is not None:
            cfg.adaptive_launches = not self.trace_launches
        if self.metrics_address is not None:
            cfg.metrics_address = self.metrics_address


def _run_settings(path, flags: _RunFlags):
    """The file, the environment, then the flags over them (again at each
    SIGHUP): the checked settings and the warnings of their loading."""
    import os
    from mmtrace.agent.config.environment import load_layers
    from mmtrace.agent.config.settings import check as check_config
    cfg, warnings = load_layers(path, os.environ)
    flags.apply(cfg)
    return check_config(cfg), warnings


def _run_daemon(cfg, load_config, log):
    """The daemon in the foreground until it is stopped; `load_config`
    reads the settings again at each SIGHUP."""
    why_not = set_niceness(cfg.nice)
    if why_not:
        log.warning(why_not)
    from mmtrace.exporters.live.prometheus import MetricsAddressError
    from mmtrace.agent.daemon.loop import Daemon
    from mmtrace.agent.safe_files import UnsafePathError
    from mmtrace.agent.daemon.signals import StopDeadline
    daemon = Daemon(cfg, compile_apart=True)     # this process's only load
    daemon.stop.install()
    deadline = StopDeadline()
    deadline.install()
    try:
        daemon.run(load_config=load_config)
    except (MetricsAddressError, UnsafePathError) as exc:
        daemon.close()
        raise MmtraceError(str(exc)) from None
    finally:
        deadline.cancel()


# The running daemon's socket (its own permission errors say more than click's).
_daemon_socket = click.option(
    "--socket", "socket_path", type=click.Path(dir_okay=False, readable=False),
    default="/run/mmtrace/mmtrace.sock", show_default=True, help="The daemon's hint socket.")


def _check(cfg, warnings, path):
    """`run --check`: the report on stdout, a failure as one line and exit 1."""
    import os
    from mmtrace.agent.daemon import preflight
    from mmtrace.agent.config.environment import variables
    known = variables()
    named = [name for name in sorted(os.environ) if name in known]
    sources = f"config {path}" if path else "built-in defaults"
    if named:
        sources += " with " + ", ".join(named)
    report = preflight.run_check(cfg, sources, warnings,
                                 compile_apart=True)     # this process's only load
    click.echo("mmtrace run --check:")
    click.echo("\n".join(report.lines()))
    if report.failures:
        first = report.failures[0]
        click.echo(f"mmtrace: error: the daemon cannot start: {first.name}: {first.detail}",
                   err=True)
        sys.exit(1)
    click.echo("the daemon can start")


@cli.command()
@_daemon_socket
@click.option("--timeout", type=Seconds(1, 600), default=60.0,
              show_default=True, help="Seconds to wait for the file to be written.")
def dump(socket_path, timeout):
    """Have the running daemon write its flight-recorder ring now; print the file.

    The same recording an anomaly writes (the last 30 s of every stream,
    with the probes, names and hint audit), at once and past the flight
    recorder's minimum interval; requests within 5 s share one file.
    The file lies in the daemon's state directory, readable by root and
    the daemon's user. Needs access to the socket (root or its group).
    SIGUSR2 to the daemon (`systemctl kill -s USR2 mmtrace`) does the same,
    with the file named in its log.

    \b
    Examples:
      sudo mmtrace dump
      sudo mmtrace report "$(sudo mmtrace dump)"
    """
    from pathlib import Path
    from mmtrace.exporters.terminal.daemon_client import NoDaemon, ask
    try:
        reply = ask(Path(socket_path), "dump", timeout)
    except (NoDaemon, ValueError) as exc:
        raise MmtraceError(str(exc)) from None
    if not isinstance(reply.get("path"), str):
        raise MmtraceError(f"expected the file's path in the daemon's dump reply, got "
                           f"{reply.get('path')!r}")
    click.echo(reply["path"])


@cli.command()
@_daemon_socket
@click.option("--interval", type=Seconds(0.1, 3600), default=1.0,
              show_default=True, help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one screen and exit (for scripts).")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's status as JSON and exit.")
def top(socket_path, interval, once, as_json):
    """Live view of the running daemon, refreshed every second; q quits.

    Per process doing GPU/NPU work, by its name: run-queue p99 of its
    device threads and sync-wait p99 (both in ms), launches/s ("off" while
    the per-launch probes wait for an alarm) and memcpy GB/s, over the last
    5 s; then the active anomalies and the latest hints; then what was
    lost. Works over ssh in any terminal. Needs access to the socket (root
    or its group).

    \b
    Examples:
      sudo mmtrace top
      sudo mmtrace top --once
      sudo mmtrace top --json | jq '.processes[0]'
    """
    from pathlib import Path
    from mmtrace.exporters.terminal import top as top_view
    path = Path(socket_path)
    try:
        if once or as_json:
            status = top_view.fetch_status(path)
            click.echo(json.dumps(status, indent=1) if as_json
                       else "\n".join(top_view.render(status)))
            return
        top_view.run(path, interval)
    except (top_view.NoDaemon, ValueError) as exc:
        raise MmtraceError(str(exc)) from None


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False), required=False)
@click.option("--pid", "pids", type=click.IntRange(1, 4_194_304), multiple=True,
              help="Only this process (repeat for more). Without FILE: ask the running "
                   "daemon about it, live.")
@click.option("--window", metavar="START:END",
              help="CLOCK_MONOTONIC seconds as report prints them (1234.5:1250), or "
                   "nanoseconds. Default: the whole recording; live, the last --last seconds.")
@click.option("--last", "last_s", type=click.FloatRange(1, 3600), default=10.0,
              show_default=True, help="Live: the seconds before now to explain.")
@click.option("--json", "as_json", is_flag=True, help="The spec's JSON (processes ranked by impact).")
@_daemon_socket
def explain(file, pids, window, last_s, as_json, socket_path):
    """Say why a process is slow: where its launching threads' time went, the
    verdict, who took the CPU, the chain from symptom to cause, and the fix.

    Each process that made GPU/NPU calls gets its launching threads' wall
    time split into on_cpu, runnable (waiting on a run queue), sync (in a
    device sync), copy (in a synchronous copy) and blocked (asleep for
    anything else), and a verdict: cpu_starved (runnable; the culprits are
    the threads that held those CPUs), host_bound (on the CPU between
    launches), bus_bound (synchronous copies, or copies near the link's
    capacity), device_bound (device syncs), npu_queue (syncs on an NPU
    whose queue is long), blocked (asleep off the device, more than
    before), input_shift (attention entropy moved), or healthy. A window is
    read against the 10 s before it (the file's first seconds when it
    starts there): a share that rose well past it is a cause, as is one
    past its own level ([diagnosis] in the config lists the levels).
    Windows are whole seconds. The timeline shows the verdict every 5 s.

    --json: {"processes": [...]} ranked by impact, each with pid, comm,
    window (start_ns, end_ns, wall clock), verdict, shares (on_cpu,
    runnable, sync, copy, blocked), causes (verdict, share, evidence),
    culprits (pid, tid, comm, share), chain (symptom first), fixes,
    reference, and over a file a timeline. The same split is live in the
    metrics mmtrace_launcher_time_share{process,state},
    mmtrace_launcher_runnable_threshold and _baseline, and in `mmtrace top`.

    \b
    Examples:
      mmtrace explain incident.mmtr
      mmtrace explain incident.mmtr --window 1234.5:1250 --pid 4242
      mmtrace explain incident.mmtr --json | jq '.processes[0].verdict'
      sudo mmtrace explain --pid 4242           # live, the last 10 s
    """
    from mmtrace.agent.recording.window_arg import parse_window
    from mmtrace.exporters.terminal.explain_view import format_text
    span = parse_window(window)
    if file is None:
        if not pids:
            raise MmtraceError("explain: expected a recording FILE, or --pid PID to ask the "
                               "running daemon")
        from pathlib import Path
        from mmtrace.exporters.terminal.daemon_client import NoDaemon, explain as ask_explain
        try:
            answer = ask_explain(Path(socket_path), list(pids), span, last_s)
        except (NoDaemon, ValueError) as exc:
            raise MmtraceError(str(exc)) from None
    else:
        from mmtrace.agent.recording.explain import explain_recording
        answer = _streamed(_open(file), lambda rec: explain_recording(
            rec, span, list(pids) or None))
    click.echo(json.dumps(answer, indent=2) if as_json else format_text(answer))


@cli.command()
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False),
              help="The daemon's TOML configuration, for its socket and state_dir (as "
                   "`run` reads them, MMTRACE_SOCKET and MMTRACE_STATE_DIR over it).")
# Not checked here (readable, a directory): the server starts as it does
# from --config, and each call says what is wrong, as the rights stand then.
@click.option("--state-dir", type=click.Path(readable=False),
              help="The daemon's state directory, where its flight recordings are "
                   "(default /var/lib/mmtrace).")
@click.option("--socket", "socket_path", type=click.Path(readable=False),
              help="The daemon's socket (default /run/mmtrace/mmtrace.sock).")
@click.option("--recordings", "recording_roots", type=click.Path(), multiple=True,
              help="Also let the tools read recordings in this directory, or this file; "
                   "repeatable. Nothing outside these and the state directory is read.")
@click.option("--allow-dump", is_flag=True,
              help="Let the `dump` tool have the daemon write a flight recording now "
                   "(off: the server changes nothing).")
@click.option("--max-read-gib", type=click.FloatRange(min=0, min_open=True),
              default=8.0, show_default=True,
              help="The largest recording (GiB, its size as the file system says) a tool "
                   "call reads; the server serves one call at a time, and 8 GiB takes "
                   "about 20 s. A larger file is a tool error naming this flag.")
def mcp(config_path, state_dir, socket_path, recording_roots, allow_dump, max_read_gib):
    """Serve the Model Context Protocol on stdin/stdout, for an AI assistant.

    An assistant (its MCP client starts this command) can then ask the
    running daemon and the flight recordings why latency went up. Tools:
    status (what `top` shows), anomalies, explain (a pid live, or a
    recording), report (a recording), recordings (the flight recordings,
    with their trigger and time), series (percentiles of a latency series),
    hints, and dump (only with --allow-dump). The prompt
    investigate-latency-regression walks through them.

    It runs with the caller's rights and needs no root: the daemon is
    reached through its socket (root or the socket's group), recordings
    through the file system, only under the state directory and the
    --recordings paths (`..` and links that lead out are refused). Every bad
    call is answered with a tool error naming what was expected; the server
    goes on. Logs go to stderr.

    \b
    Examples:
      mmtrace mcp
      mmtrace mcp --config /etc/mmtrace/mmtrace.toml --recordings ~/incidents
      sudo -g mmtrace mmtrace mcp --allow-dump
    In an assistant's MCP configuration (README.md, "Ask an assistant"):
      {"mcpServers": {"mmtrace": {"command": "mmtrace", "args": ["mcp"]}}}
    """
    from pathlib import Path
    from mmtrace.agent.daemon import log_format
    from mmtrace.agent.mcp.roots import RecordingRoots
    from mmtrace.agent.mcp.server import serve
    from mmtrace.agent.mcp.tools import Investigation
    log_format.configure("warning")
    flags = _RunFlags((), (), state_dir, socket_path, None, None)
    cfg, _ = _run_settings(Path(config_path) if config_path else None, flags)
    roots = RecordingRoots(cfg.state_dir, [Path(p) for p in recording_roots],
                           max_read_gib=max_read_gib)
    serve(Investigation(cfg.socket, roots, allow_dump=allow_dump))


def main():
    """The console script: every error is one line on stderr and exit
    status 2, a usage error too (click's own would print the usage and a
    hint around it)."""
    no_args_help = getattr(click.exceptions, "NoArgsIsHelpError", ())
    try:
        code = cli.main(prog_name="mmtrace", standalone_mode=False)
    except no_args_help as exc:        # plain `mmtrace`: the help, as click prints it
        exc.show()
        sys.exit(exc.exit_code)
    except click.UsageError as exc:
        where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        click.echo(f"mmtrace: error: {exc.format_message()}{where}", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except MmtraceError as exc:         # raised outside a command (Commands converts those)
        click.echo(f"mmtrace: error: {exc.message}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("mmtrace: aborted", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
