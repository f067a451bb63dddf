"""The one ingest path (agent/ingest/pipeline.py) without eBPF: batches from the
rings reach every sink in order, with their threads' processes filled in
and the device batches' names; a producer that never stops cannot hold
the caller; and the recording's sink follows a device side wired late."""

import numpy as np

from mmtrace.agent.recording import file_format as recording
from mmtrace.agent.ingest.pipeline import Ingest
from mmtrace.agent.recording.recorder import RecordingSink, SCHEMAS
from mmtrace.agent.ingest.threads import ThreadProcesses
from mmtrace.bpf.device import DEV_EVENT
from mmtrace.bpf.sched import RUNQ_EVENT


class Rings:
    """The loaded probes as ingest sees them: read() gives queued batches."""

    def __init__(self, rounds, forever=False):
        self.rounds, self.forever, self.learnt = list(rounds), forever, {}

    def read(self):
        if self.forever:
            return {"cpu": runq(1)}
        return self.rounds.pop(0) if self.rounds else {}

    def learn_threads(self, learnt):
        self.learnt.update(learnt)


class Names:
    def __init__(self):
        self.seen = 0

    def process(self, batch):
        self.seen += len(batch)
        return [[int(batch["pid"][0]), 0x1000, "vision::patch(int)"]]


class Kept:
    def __init__(self):
        self.got = []

    def batch(self, stream, events, op_names):
        self.got.append((stream, events["pid"].tolist(), op_names))


def runq(n, pid=0, tid=None):
    ev = np.zeros(n, RUNQ_EVENT)
    ev["pid"], ev["tid"] = pid, tid if tid is not None else 4243
    return ev


def dev(n, pid=4242):
    ev = np.zeros(n, DEV_EVENT)
    ev["pid"], ev["tid"] = pid, 4243
    return ev


def test_each_batch_reaches_every_sink_in_order_with_its_process_and_names(tmp_path):
    proc = tmp_path / "proc"
    (proc / "4243" / "status").parent.mkdir(parents=True)
    (proc / "4243" / "status").write_text("Name:\tvision\nTgid:\t4242\n")
    rings = Rings([{"cpu": runq(2), "dev": dev(3)}, {"dev": dev(1)}])
    first, second = Kept(), Kept()
    ingest = Ingest(rings, ThreadProcesses(proc), sinks=[first, second])
    assert ingest.drain() == 6
    assert first.got == second.got == [("cpu", [4242, 4242], []), ("dev", [4242] * 3, []),
                                       ("dev", [4242], [])]
    assert rings.learnt == {4243: 4242}             # the kernel is told what was learnt
    names = ingest.names = Names()                  # the device side, wired late
    rings.rounds = [{"cpu": runq(1, pid=7), "dev": dev(2)}]
    assert ingest.drain() == 3
    assert first.got[-2:] == [("cpu", [7], []),
                              ("dev", [4242, 4242], [[4242, 0x1000, "vision::patch(int)"]])]
    assert names.seen == 2                          # the CPU stream is not named


def test_a_producer_that_never_stops_cannot_hold_the_caller():
    kept = Kept()
    assert Ingest(Rings([], forever=True), ThreadProcesses(), sinks=[kept],
                  max_rounds=3).drain() == 3
    assert len(kept.got) == 3


class Meta:
    def __init__(self):
        self.tables = []

    def table(self, key, rows):
        self.tables.append((key, rows))


class Device:
    def __init__(self):
        self.meta = Meta()


def test_the_recordings_sink_writes_events_and_names_to_the_device_side_of_now(tmp_path):
    path = tmp_path / "r.mmtr"
    writer = recording.RecordingWriter(path, SCHEMAS)
    before, after = Device(), Device()
    sink = RecordingSink(writer, before)
    sink.batch("cpu", runq(2, pid=9), [])
    sink.device = after                             # the device side once compiled
    sink.batch("dev", dev(3), [[4242, 0x1000, "k"]])
    writer.close({})
    assert before.meta.tables == [] and after.meta.tables == [("op_names", [[4242, 0x1000, "k"]])]
    rec = recording.read_recording(path)
    assert rec.events["cpu.runq"]["pid"].tolist() == [9, 9]
    assert len(rec.events["dev.event"]) == 3
