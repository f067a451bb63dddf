"""The client side of the demo: mixed load on the server's dispatcher, each
text request's latency kept with the phase it was sent in; and CPU
contention injected on the server's CPUs by busy processes."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

BUSY_LOOP = "while True: pass"


class MixedLoad:
    """Vision images kept `vision_in_flight` at a time (the next one goes as
    soon as one is done, so full vision batches are always waiting) and an
    open-loop text stream at `text_rate` requests per second. One thread
    each, so the load itself takes little of the server's CPU."""

    def __init__(self, server, *, vision_in_flight: int = 16, text_rate: float = 40.0):
        self.server = server
        self.vision_in_flight = vision_in_flight
        self.text_rate = text_rate
        self.phase = "warmup"
        self.text: list[tuple[int, float, str]] = []        # (sent_ns, latency_ms, phase)
        self.vision_done: list[tuple[int, str]] = []         # (done_ns, phase)
        self.errors = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._vision, daemon=True, name="demo-vision"),
                         threading.Thread(target=self._text_stream, daemon=True, name="demo-text")]

    def start(self):
        for t in self._threads:
            t.start()
        return self

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)

    def _vision(self):
        image = self.server.image(0)
        slots = threading.Semaphore(self.vision_in_flight)

        def done(future):
            slots.release()
            if future.exception() is not None:
                self.errors += 1
            else:
                self.vision_done.append((time.monotonic_ns(), self.phase))
        while not self._stop.is_set():
            if not slots.acquire(timeout=0.5):
                continue
            try:
                self.server.dispatcher.submit(image, modality="vision").add_done_callback(done)
            except Exception:
                slots.release()
                self.errors += 1
                time.sleep(0.05)

    def _text_stream(self):
        period = 1.0 / self.text_rate
        next_at = time.monotonic()
        seq = 0
        while not self._stop.is_set():
            next_at += period
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            seq += 1
            sent, phase = time.monotonic_ns(), self.phase
            try:
                future = self.server.dispatcher.submit(self.server.prompt(seq % 64),
                                                       modality="text")
            except Exception:
                self.errors += 1
                continue
            future.add_done_callback(lambda f, sent=sent, phase=phase: self._text_done(f, sent, phase))

    def _text_done(self, future, sent: int, phase: str):
        if future.exception() is not None:
            self.errors += 1
            return
        self.text.append((sent, (time.monotonic_ns() - sent) / 1e6, phase))

    def text_latencies(self, phase: str, since_ns: int = 0, until_ns: int | None = None) -> np.ndarray:
        return np.array([ms for sent, ms, p in list(self.text)
                         if p == phase and sent >= since_ns and (until_ns is None or sent < until_ns)])

    def vision_completed(self, phase: str) -> int:
        return sum(1 for _, p in list(self.vision_done) if p == phase)


def percentiles(latencies_ms: np.ndarray) -> dict:
    if not len(latencies_ms):
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    p50, p99 = np.percentile(latencies_ms, [50, 99])
    return {"n": int(len(latencies_ms)), "p50_ms": round(float(p50), 2),
            "p99_ms": round(float(p99), 2)}


class Contention:
    """`busy` processes spinning on `cpus`, each `nice` steps above the
    server's priority (niceness lowered by that much)."""

    def __init__(self, cpus, busy: int = 2, nice: int = 0):
        self.cpus = set(cpus)
        self.busy = busy
        self.nice = nice
        self.procs: list[subprocess.Popen] = []

    def start(self):
        for _ in range(self.busy):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", BUSY_LOOP],
                preexec_fn=self._place))
        return self

    def _place(self):
        os.sched_setaffinity(0, self.cpus)
        os.nice(-self.nice)

    def stop(self):
        for proc in self.procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        self.procs = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
