"""Hung devices (anomaly `device_hang`): a sync, or a call that blocks
until the device is done (a synchronous copy, a blocking model
execution), that has not returned after `after_s`. Needs no return: it
reads the calls in flight (agent/kernel/calls_in_flight.py), each with
its process, thread, API, stream handle, device and entry time. One
anomaly per call: firing once it is overdue, resolved when it returns (or
its thread goes)."""

DETECTOR = "device_hang"


class DeviceHang:
    def __init__(self, after_s: float = 10.0):
        if after_s <= 0:
            raise ValueError(f"expected after_s > 0, got {after_s}")
        self.after_ns = int(after_s * 1e9)
        self.firing: dict[tuple[int, int, int], dict] = {}  # (tid, api, entry ns) -> anomaly

    @classmethod
    def of(cls, settings) -> "DeviceHang":
        return cls(settings.after_s)

    def stuck(self, calls: list[dict], now_ns: int) -> list[dict]:
        """The calls of `calls` past the threshold."""
        return [c for c in calls if now_ns - c["ts_ns"] >= self.after_ns]

    def check(self, calls: list[dict], now_ns: int) -> list[dict]:
        """`calls`: the blocking calls in flight now (dicts with pid, tid,
        comm, api, stream, stream_handle, device, ts_ns)."""
        out = []
        overdue = {(c["tid"], c["api_id"], c["ts_ns"]): c for c in self.stuck(calls, now_ns)}
        for key, call in overdue.items():
            if key not in self.firing:
                self.firing[key] = self._anomaly(call, "firing", now_ns)
                out.append(self.firing[key])
        for key in [k for k in self.firing if k not in overdue]:
            was = self.firing.pop(key)
            out.append({**was, "state": "resolved", "ts_ns": int(now_ns),
                        "evidence": {**was["evidence"],
                                     "waited_s": round((now_ns - key[2]) / 1e9, 3)}})
        return out

    def _anomaly(self, call: dict, state: str, now_ns: int) -> dict:
        waited_s = round((now_ns - call["ts_ns"]) / 1e9, 3)
        evidence = {"pid": call["pid"], "tid": call["tid"], "comm": call.get("comm", ""),
                    "api": call["api"], "stream": call["stream"],
                    "stream_handle": call["stream_handle"], "device": call["device"],
                    "since_ns": int(call["ts_ns"]), "waited_s": waited_s,
                    "after_s": self.after_ns / 1e9,
                    "verdict": "npu_hang" if call["stream"] == "npu" else "gpu_hang"}
        if "unretired" in call:     # what the device has stopped retiring behind it
            evidence["unretired"] = call["unretired"]
            evidence["oldest_unretired_ns"] = call.get("oldest_unretired_ns")
        return {"detector": DETECTOR, "state": state, "ts_ns": int(now_ns),
                "series": f"device_hang{{pid={call['pid']},tid={call['tid']}}}",
                "pid": call["pid"], "comm": call.get("comm", ""), "evidence": evidence}
