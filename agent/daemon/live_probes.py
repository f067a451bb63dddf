"""The daemon's probes: the CPU stream live first, the GPU/NPU programs
compiled after it (in a thread, while the loop drains) and wired once
they are; the libraries discovery finds attached as they appear; what the
probes hold and what the kernel lost since the start."""

import logging
import time

from mmtrace.bpf import counters as bpf_counters

from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.ingest.device_names import device_names
from mmtrace.agent.ingest.pipeline import Ingest
from mmtrace.agent.kernel import compiler_memory
from mmtrace.agent.kernel import probes as probe_loader
from mmtrace.agent.kernel.device_compile import DeviceCompile, device_programs_failed
from mmtrace.agent.kernel.device_sources import DeviceSources, attach_and_release
from mmtrace.agent.kernel.probes import CPU_PROBE_STATE

log = logging.getLogger("mmtrace.daemon")



def probe_options(cfg: DaemonConfig) -> probe_loader.ProbeOptions:
    """What the daemon's configuration asks of the probes (`run` and
    `run --check` alike)."""
    return probe_loader.ProbeOptions(pids=tuple(cfg.pids),
                                     trace_launches=not cfg.adaptive_launches,
                                     launch_return_every=cfg.launch_return_every,
                                     dev_ringbuf_pages=cfg.device_ringbuf_mib * 256)

class LiveProbes:
    def __init__(self, config: DaemonConfig, compile_apart: bool = False):
        self.config = config
        self.compile_apart = compile_apart      # probes.load_cpu's
        self.loaded = None
        self.sources = None
        self.ingest: Ingest | None = None           # once the CPU stream is loaded (start)
        self.probe_states: list[dict] = [CPU_PROBE_STATE]
        self.counters_at_start: dict[str, int] = {}
        self._devices = None                # DeviceCompile while the GPU/NPU programs compile
        self._began = 0.0

    def start(self, threads, sink):
        """The CPU stream loaded and its ingest path made, feeding `sink`;
        the GPU/NPU programs start compiling."""
        cfg = self.config
        self._began = time.monotonic()
        options = probe_options(cfg)
        self.sources = DeviceSources(cfg.libs, cfg.pids, discover=True, warn=log.warning,
                                     interval_s=cfg.discover_interval_s)
        try:
            self.loaded = probe_loader.load_cpu(options, compile_apart=self.compile_apart)
            # One round a tick: the tick's other work (socket, detectors) waits for it.
            self.ingest = Ingest(self.loaded, threads, sinks=[sink], max_rounds=1)
            self.counters_at_start = self.loaded.counters()
        except BaseException:
            self.sources.close()
            raise
        log.info("cpu stream live (%.2f s)", time.monotonic() - self._began)
        self._devices = DeviceCompile(self.loaded)

    @property
    def compiling(self) -> bool:
        return self._devices is not None

    @property
    def device(self):
        return self.loaded.device if self.loaded is not None else None

    def wire_devices(self):
        """Once the GPU/NPU programs are compiled: wire and attach them, and
        the ingest path names their ops from then on."""
        devices = self._devices
        if devices is None or not devices.ready(self.sources):
            return
        self._devices = None
        cfg = self.config
        error = devices.finish()
        if error is not None:
            log.error("GPU/NPU probes unavailable (%s); the CPU stream goes on", error)
            self.probe_states.append(device_programs_failed(error))
        else:
            self.ingest.names = device_names(self.loaded, self.sources.known_files)
            self.attach_new()
            compiler_memory.release()       # what the first discovery scan left, too
            log.info("gpu/npu probes live (%.2f s)", time.monotonic() - self._began)
        log.info("tracing: pids=%s, per-launch probes %s, %s, flight recordings in %s",
                 list(cfg.pids) or "all", "on alarm" if cfg.adaptive_launches else "on",
                 probe_loader.launch_returns(self.loaded.options), cfg.state_dir)

    def attach_new(self):
        # The device's own states are read when needed: kept here, every
        # library ever probed stayed in them.
        if self.sources is not None and self.device is not None:
            attach_and_release(self.loaded.device, self.sources, self.ingest.names)

    def footprint(self) -> dict:
        """What the GPU/NPU probes hold now (files, links, descriptors) and
        what discovery counted: files released, over the cap, processes
        gone while being read or before any scan read them."""
        device = self.device
        out = device.footprint() if device is not None else {}
        # The first scan runs in a thread of its own: its counters once it is over.
        found = self.sources.counters() if self.sources is not None and self.sources.ready() \
            else {}
        for name in ("probed", "waiting", "over_cap", "released", "vanished"):
            out[f"discovery_{name}"] = found.get(name, 0)
        if device is not None and found:
            # Lived less than a scan: whatever only they loaded went unprobed.
            out["discovery_exited_unread"] = self.loaded.counters().get("exited_unread", 0)
        return out

    def states(self) -> list[dict]:
        """What is probed now: released files' states are gone with them."""
        device = self.device
        return self.probe_states + (device.states() if device is not None else [])

    def losses(self) -> dict[str, int]:
        """What the kernel lost since the start, by counter."""
        if self.loaded is None:
            return {}
        rise = bpf_counters.since(self.loaded.counters(), self.counters_at_start)
        return {f"kernel.{name}": rise.get(name, 0) for name in bpf_counters.LOSS_COUNTERS}

    def close(self, waiter):
        if self._devices is not None:
            self._devices.thread.join()     # compiling on the scheduler's maps: let it end
            self._devices = None
        if self.sources is not None:
            self.sources.close()            # a stop during the first scan: let it end
        if self.loaded is not None:
            for ring in self.loaded.rings:
                for fd in ring.filenos():
                    waiter.forget(fd)
            self.loaded.close()
            self.loaded = None
            self.ingest = None
