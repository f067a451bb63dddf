"""The in-process dispatcher: modality queues per device, a batch order
with a starvation bound, session affinity and device weights, hints with a
TTL, and latency / entropy reports to the agent.

One worker thread per device takes the next ready batch of that device's
queues (see batching, order) and runs the user's handler on it outside the
lock; the handler's results, or its exception, settle the batch's futures.
A request is bound to its device when submitted (see placement), so a
session's steps reach the device that holds its state.
"""

import asyncio
import logging
import threading
import time
from concurrent.futures import Future

from mmtrace.dispatch.agent_link import DEFAULT_CAPACITY, DEFAULT_RECONNECT_MAX_S, DEFAULT_SERIES, AgentLink
from mmtrace.dispatch.batching import ModalityQueue, Request
from mmtrace.dispatch.hints import HintBook
from mmtrace.dispatch.order import DEFAULT_STARVATION_LIMIT, BatchOrder
from mmtrace.dispatch.placement import DEFAULT_IMBALANCE_ABS, DEFAULT_IMBALANCE_REL, Placement
from mmtrace.dispatch.queue_config import QueueConfig, parse_queues

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/mmtrace/mmtrace.sock"


class DispatcherClosed(RuntimeError):
    """The dispatcher closed before the request ran, or was closed when it came."""


class Shed(RuntimeError):
    """A non-core request refused because a degrade hint is active for its modality."""


class _Device:
    __slots__ = ("name", "queues", "order", "wake", "thread")

    def __init__(self, name, modalities, lock, starvation_limit):
        self.name = name
        self.queues = {m: ModalityQueue(m) for m in modalities}
        self.order = BatchOrder(starvation_limit)
        self.wake = threading.Condition(lock)
        self.thread = None


class Dispatcher:
    """Batches requests per modality and runs them on devices.

    devices: device names, e.g. ["cuda:0", "cuda:1"]. handler(device,
    modality, items) -> list runs one batch and returns one result per item,
    in order; it is called from the device's worker thread. socket: the
    agent's hint socket, or None to run without an agent. queues: per
    modality overrides of {"batch_max", "wait_ms", "priority"}.

    Reports to the agent, per request that succeeded, a `sample` with
    series "e2e" (`series=`), its modality, and value_ms from submit() to
    the result. `entropy_sink` forwards watch() samples. Reports wait in a
    queue of `telemetry_capacity` entries; when it is full (no agent, or
    one that does not read) new ones are dropped and counted in
    state()["agent"]["dropped"].
    """

    def __init__(self, devices, handler, *, socket=DEFAULT_SOCKET, queues=None,
                 starvation_limit: int = DEFAULT_STARVATION_LIMIT,
                 imbalance_abs: int = DEFAULT_IMBALANCE_ABS, imbalance_rel: float = DEFAULT_IMBALANCE_REL,
                 client: str = "mmtrace.dispatch", series: str = DEFAULT_SERIES,
                 reconnect_max_s: float = DEFAULT_RECONNECT_MAX_S, telemetry_capacity: int = DEFAULT_CAPACITY):
        devices = list(devices) if not isinstance(devices, str) else None
        if not devices or not all(isinstance(d, str) and d for d in devices) or len(set(devices)) != len(devices):
            raise ValueError(f"devices: expected a non-empty list of distinct names, got {devices!r}")
        if not callable(handler):
            raise TypeError(f"handler: expected a callable(device, modality, items), got {type(handler).__name__}")
        self._handler = handler
        self._base = parse_queues(queues)
        self._effective: dict[str, QueueConfig] = dict(self._base)
        self._lock = threading.Lock()
        self._placement = Placement(devices, imbalance_abs=imbalance_abs, imbalance_rel=imbalance_rel)
        self._hints = HintBook(devices, list(self._base))
        self._devices = {d: _Device(d, self._base, self._lock, starvation_limit) for d in devices}
        self._closed = False
        self.counts = {"submitted": 0, "completed": 0, "failed": 0, "shed": 0, "cancelled": 0,
                       "batches": 0, "hints_refused": 0}
        self._link = None
        if socket is not None:
            self._link = AgentLink(socket, self.apply_hint, on_tick=self._expire_due, client=client,
                                   series=series, reconnect_max_s=reconnect_max_s,
                                   capacity=telemetry_capacity)
        for dev in self._devices.values():
            dev.thread = threading.Thread(target=self._work, args=(dev,), daemon=True,
                                          name=f"mmtrace-dispatch-{dev.name}")
            dev.thread.start()

    # ---- requests

    def submit(self, item, *, modality: str, session=None, core: bool = True) -> Future:
        """Queue `item`; the future holds its result. `session` keeps a
        session's requests on one device; core=False marks work a degrade
        hint may shed."""
        now = time.monotonic_ns()
        with self._lock:
            if self._closed:
                raise DispatcherClosed("dispatcher is closed; submit() refused")
            if modality not in self._base:
                raise ValueError(f"modality: expected one of {list(self._base)}, got {modality!r}")
            hints = self._hints
            if hints.next_expiry_ns is not None and now >= hints.next_expiry_ns:
                self._expire(now)
            cfg = self._effective[modality]
            self.counts["submitted"] += 1
            fx = hints.effects
            if not core and fx.degraded(modality):
                self.counts["shed"] += 1
                future = Future()
                future.set_exception(Shed(f"{modality} request shed: a degrade hint is active "
                                          "and the request was submitted with core=False"))
                return future
            placement = self._placement
            device = placement.place(session, fx.weights, fx.routes.get(modality))
            request = Request(item, modality, session, device, now)
            dev = self._devices[device]
            queue = dev.queues[modality]
            queue.push(request)
            placement.load[device] += 1
            n = len(queue)
            if n == 1 or n >= cfg.batch_max:  # a new deadline, or a full batch
                dev.wake.notify()
        return request.future

    async def submit_async(self, item, *, modality: str, session=None, core: bool = True):
        """submit() for asyncio: awaits the item's result."""
        return await asyncio.wrap_future(self.submit(item, modality=modality, session=session, core=core))

    def forget_session(self, session) -> bool:
        """Drop a finished session's device binding; True if it was held."""
        with self._lock:
            return self._placement.forget(session)

    def entropy_sink(self, samples: list) -> None:
        """A watch() sink: queues the samples for the agent, never blocks."""
        if self._link is not None:
            self._link.offer(("entropy", samples))

    # ---- hints and state

    def apply_hint(self, hint: dict) -> None:
        """Apply one hint object as the socket delivers it; ValueError
        naming the problem when it does not follow the spec."""
        now = time.monotonic_ns()
        with self._lock:
            try:
                self._hints.apply(hint, now)
            except ValueError:
                self.counts["hints_refused"] += 1
                raise
            self._on_effects()
            for dev in self._devices.values():
                dev.wake.notify()        # a lower batch cap may make a batch ready now

    def state(self) -> dict:
        now = time.monotonic_ns()
        with self._lock:
            self._expire(now)
            fx = self._hints.effects
            depth = {m: sum(len(d.queues[m]) for d in self._devices.values()) for m in self._base}
            placement = self._placement
            return {
                "queues": {m: {**c.as_dict(), "depth": depth[m], "defaults": self._base[m].as_dict(),
                               "degraded": fx.degraded(m), "devices": fx.routes.get(m)}
                           for m, c in self._effective.items()},
                "hints": self._hints.views(now),
                "weights": {d: fx.weights.get(d, 1.0) for d in self._devices},
                "devices": {d: {"load": placement.load[d]} for d in self._devices},
                "sessions": len(placement.sessions),
                "imbalance_overrides": placement.overrides,
                "counts": dict(self.counts),
                "hints_applied": self._hints.applied, "hints_expired": self._hints.expired,
                "agent": ({**self._link.stats, "flush_s": self._link.flush_interval()}
                          if self._link is not None else None),
            }

    def _expire_due(self):
        """Expire hints on time even when no request comes (the link's
        reporting pace depends on them)."""
        now = time.monotonic_ns()
        due = self._hints.next_expiry_ns
        if due is not None and now >= due:
            with self._lock:
                self._expire(now)

    def _expire(self, now: int):
        if self._hints.expire(now):
            self._on_effects()

    def _on_effects(self):
        fx = self._hints.effects
        eff = {}
        for m, base in self._base.items():
            cap = min(base.batch_max, fx.batch_cap.get(m, base.batch_max))
            eff[m] = QueueConfig(cap, base.wait_ms, fx.priority.get(m, base.priority))
        self._effective = eff
        if self._link is not None:
            self._link.contended = fx.cpu_contention

    # ---- workers

    def _work(self, dev: _Device):
        while True:
            with self._lock:
                taken = self._next_batch(dev)
            if taken is None:
                return
            self._run(dev.name, *taken)

    def _next_batch(self, dev: _Device):
        """The next batch to run on `dev`, waiting for one; None once closed."""
        while not self._closed:
            now = time.monotonic_ns()
            hints = self._hints
            if hints.next_expiry_ns is not None and now >= hints.next_expiry_ns:
                self._expire(now)
            ready, deadline = [], None
            for m, queue in dev.queues.items():
                if not queue.requests:
                    continue
                cfg = self._effective[m]
                if queue.ready(now, cfg.batch_max, cfg.wait_ns):
                    ready.append((m, cfg.rank, queue.oldest_ns()))
                else:
                    due = queue.deadline_ns(cfg.wait_ns)
                    deadline = due if deadline is None else min(deadline, due)
            if ready:
                m = dev.order.pick(ready)
                return m, dev.queues[m].take(self._effective[m].batch_max)
            dev.wake.wait(None if deadline is None else max(deadline - now, 0) / 1e9)
        return None

    def _run(self, device: str, modality: str, batch: list[Request]):
        live = [r for r in batch if r.future.set_running_or_notify_cancel()]
        results, error = None, None
        if live:
            try:
                results = self._handler(device, modality, [r.item for r in live])
                if not isinstance(results, (list, tuple)) or len(results) != len(live):
                    raise ValueError(f"handler({device!r}, {modality!r}, items): expected a list of "
                                     f"{len(live)} results, got "
                                     + (f"{len(results)}" if isinstance(results, (list, tuple))
                                        else type(results).__name__))
            except Exception as exc:
                log.debug("handler failed on %s/%s: %r", device, modality, exc)
                error = exc
        done = time.monotonic_ns()
        with self._lock:
            self._placement.load[device] -= len(batch)
            counts = self.counts
            counts["batches"] += 1
            counts["cancelled"] += len(batch) - len(live)
            counts["failed" if error is not None else "completed"] += len(live)
        # Futures settle last: a caller woken by its result then finds this
        # thread about to wait, not still busy with bookkeeping.
        if error is not None:
            for r in live:
                r.future.set_exception(error)
            return
        if not live:
            return
        link = self._link
        if link is not None:
            for r in live:
                link.offer(("sample", modality, (done - r.submitted_ns) / 1e6, done))
        for r, result in zip(live, results):
            r.future.set_result(result)

    # ---- shutdown

    def close(self, timeout: float | None = 10.0):
        """Finish the batches already taken, fail the queued requests with
        DispatcherClosed, and disconnect from the agent. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for dev in self._devices.values():
                dev.wake.notify_all()
        for dev in self._devices.values():
            if dev.thread is not threading.current_thread():
                dev.thread.join(timeout)
        with self._lock:
            left = [r for dev in self._devices.values() for q in dev.queues.values() for r in q.drain()]
            for r in left:
                self._placement.load[r.device] -= 1
        for r in left:
            if r.future.set_running_or_notify_cancel():
                r.future.set_exception(DispatcherClosed("dispatcher closed before this request ran"))
        if self._link is not None:
            self._link.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
