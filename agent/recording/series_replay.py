"""One latency series' percentiles over the last seconds of a recording
(`mmtrace mcp`'s `series` over a file): its replay fed to the SeriesWindow
the live daemon answers with, so a file and the daemon agree."""

from mmtrace.agent.ingest import latency_series as ls
from mmtrace.agent.ingest.series_window import SeriesWindow
from mmtrace.agent.recording.replay import DEVICE, replay


def series_of(rec, name: str, window_s: float) -> dict:
    """The series `name` over the last `window_s` seconds of `rec`."""
    ends = [hi for _, hi in rec.ts_range.values()]
    end = max(ends) + 1 if ends else 0
    window = SeriesWindow(name, end - int(window_s * 1e9), end)
    submitters = ls.Submitters()          # threads that ever did device work, as the detector
    for pieces in rec.pieces(DEVICE):
        submitters.learn(pieces)
    for step in replay(rec, ["cpu.runq", DEVICE]):
        runq = step.part("cpu.runq")
        if runq is not None:
            window.add_runq(runq, submitters)
        rows = step.device_rows()
        if rows is not None:
            window.add_device(rows.events)
    return {**window.summary(), "file": str(rec.path)}
