"""The files the GPU/NPU probes go on, found while tracing, and the step
that probes what is new and releases what is gone (`record` and `run`)."""

import threading

from mmtrace.agent.errors import MmtraceError

CLOSE_WAIT_S = 10.0     # the longest a failed start waits for the first scan


class DeviceSources:
    """The libraries the GPU/NPU probes attach to: --lib paths, and what
    discovery finds while recording (new processes, new files). The first
    scan runs in a thread from creation on, beside the eBPF compilation."""

    def __init__(self, libs=(), pids=(), discover: bool = True, warn=None,
                 interval_s: float = 2.0):
        from mmtrace.agent.kernel.probed_symbols import wanted
        self.discoverer = None
        self.warn = warn
        self._warned: set[str] = set()
        self.libs = tuple(str(p) for p in libs)
        from mmtrace.agent.discovery.discoverer import Discoverer
        if discover:
            try:
                self.discoverer = Discoverer(wanted, pids=pids or None, extra_paths=self.libs,
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

    def close(self, timeout_s: float = CLOSE_WAIT_S):
        """Wait for the first scan (at most `timeout_s`: a read of a hung
        process's maps must not hang the exit): a process that exits (a load
        that failed) while the scan's thread is in C code can abort with
        "terminate called without an active exception" instead of its
        error (Python ends such threads with a forced unwind at exit)."""
        if self._scan is not None:
            self._scan.join(timeout_s)

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
        once): the device program counts the processes that exit unread.
        And discovery follows the processes the kernel says changed."""
        if self.discoverer is None or self.discoverer.on_read is not None:
            return
        mark = device.unread_exits()
        if mark is None:
            return
        for pid in self.discoverer.take_read():
            mark(pid)
        self.discoverer.on_read = mark
        changes = device.process_changes()
        if changes is not None:
            self.discoverer.follow(changes)

    def _warn_untraceable(self):
        for path, why in self.untraceable().items():
            if path not in self._warned:
                self._warned.add(path)
                if self.warn is not None:
                    self.warn(f"{path}: {why}")

    def counters(self) -> dict:
        return dict(self.discoverer.counters) if self.discoverer is not None else {}


def device_probe_target(path: str):
    from mmtrace.agent.kernel.probed_file import target_from_path
    try:
        return target_from_path(path)
    except OSError as exc:
        raise MmtraceError(f"--lib {path}: {exc.strerror}") from None


def attach_and_release(device, sources, names=None) -> list[dict]:
    """Probe the files `sources` found since the last call, release those
    it no longer holds (and the released files kept open past their time),
    and let `names` (the DeviceNames of the device stream) forget the
    processes that have exited; the states of the new probes."""
    states = [state.as_dict() for state in device.check_rewritten()]
    found = sources.targets()
    sources.mark_reads_in(device)
    for target in found:
        states += [state.as_dict() for state in device.add(target)]
    device.release(sources.released())
    if names is not None:
        names.forget_exited()
    return states
