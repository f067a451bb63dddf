"""GPU/NPU events of a recording decoded as they stream by, in bounded
memory: a bounded Aligner aligns each step against the recent past, and an
event is handed out once nothing later can change it (a submission once its
sync is seen, or once too much is held behind it)."""

import numpy as np

from mmtrace.agent.ingest.align import ALIGNED_EVENT, Aligner, ApiRoles
from mmtrace.agent.recording.device_view import DeviceContext, DeviceRows, decode_aligned, function_names
from mmtrace.agent.ingest.record_arrays import concat, take

MAX_KERNEL_NAMES = 1 << 16


class DeviceReplay:
    def __init__(self, ctx: DeviceContext, max_held: int = 1 << 16):
        from mmtrace.agent.discovery.demangle import demangle
        self.ctx = ctx
        self.max_held = max_held
        self._demangle = demangle
        # The aligner's own ring is not needed: this class holds what is not out yet.
        self._aligner = Aligner(ApiRoles.from_infos(ctx.infos), capacity=1,
                                max_age_ns=1 << 62, on_retired=self._retired)
        self._held = np.zeros(0, ALIGNED_EVENT)
        self._base = 0          # number of the first held event
        self._pushed = 0
        self._kernel_names: dict = {}
        self.forced_out = 0     # submissions handed out before their sync was seen

    def _retired(self, seq: np.ndarray, retired: np.ndarray):
        at = seq - self._base
        held = (at >= 0) & (at < len(self._held))
        self._held["retired_ns"][at[held]] = retired[held]

    def push(self, events: np.ndarray) -> DeviceRows | None:
        """Take device events (sorted by time); the rows now settled, if any."""
        if not len(events):
            return None
        new = self._aligner.push(events)
        self._pushed += len(new)
        self._held = concat([self._held, new])
        oldest = self._aligner.oldest_pending
        cut = len(self._held) if oldest is None else oldest - self._base
        if len(self._held) - cut > self.max_held:
            forced = len(self._held) - self.max_held // 2
            self.forced_out += forced - cut
            cut = forced
        return self._emit(cut)

    @property
    def horizon(self) -> int | None:
        """Stamp of the oldest event not handed out yet (None: none held)."""
        return int(self._held["ts_ns"].min()) if len(self._held) else None

    def flush_until(self, ts_ns: int) -> DeviceRows | None:
        """Hand out the held events stamped before `ts_ns`, settled or not."""
        later = np.flatnonzero(self._held["ts_ns"] >= np.uint64(max(ts_ns, 0)))
        cut = int(later[0]) if len(later) else len(self._held)
        self.forced_out += cut
        return self._emit(cut)

    def finish(self) -> DeviceRows | None:
        return self._emit(len(self._held))

    def _emit(self, cut: int) -> DeviceRows | None:
        if cut <= 0:
            return None
        # Two views of one buffer: nothing writes into what is handed out
        # (_retired writes past the cut, and the next push copies _held).
        out, self._held = self._held[:cut], self._held[cut:]
        self._base += cut
        # A call stamped at its entry arrives when it returns: a long sync
        # can come after events stamped later than it.
        ts = out["ts_ns"]
        if not (ts[1:] >= ts[:-1]).all():
            out = take(out, np.argsort(ts, kind="stable"))
        self._kernel_names.update(function_names(out, self.ctx.infos, self._demangle,
                                                 self.ctx.op_names, known=self._kernel_names))
        if len(self._kernel_names) > MAX_KERNEL_NAMES:
            for key in list(self._kernel_names)[:MAX_KERNEL_NAMES // 2]:
                del self._kernel_names[key]
        return decode_aligned(out, self.ctx, self._kernel_names)
