"""Fuzz target: the daemon's policy inputs and the hint policy against
arbitrary sequences of alarms (in the detectors' shape: arbitrary series,
keys as ingest makes them, missing or malformed, pids, modalities and
states, latencies in seconds as the detector reports them), client samples
and /proc/stat contents. decide() never raises; every hint it sends is JSON, carries a
positive TTL and is either held by a dispatcher's hint book or refused
with ValueError (a modality the dispatcher does not serve)."""

import json
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from mmtrace.agent.daemon.cpu_load import CpuLoad
    from mmtrace.agent.daemon.policy_inputs import PolicyInputs
    from mmtrace.dispatch.hints import HintBook
    from mmtrace.dispatch.policy import DURATIONS, HintPolicy, PolicySettings

# (kind, series name): the name is for people; the key says what it is about
SERIES = [("runq_delay", "runq_delay{{pid={}}}"),
          ("request_latency", "request_latency{{series=e2e,modality={}}}"),
          ("sync_wait", "sync_wait{{pid={},stream=0x0}}"), ("", "{}")]
ODD_PIDS = [True, "7", None, -1, 1 << 70, 2.5]
STATES = ["firing", "resolved", "pending"]
PROC = Path(tempfile.mkdtemp(prefix="fuzz-proc-"))


def test_one_input(data: bytes):
    fdp = atheris.FuzzedDataProvider(data)
    now = [10**9]
    inputs = PolicyInputs(CpuLoad(PROC), clock=lambda: now[0])
    durations = {"ttl_s": fdp.ConsumeFloatInRange(0.01, 60),
                 "escalate_dwell_s": fdp.ConsumeFloatInRange(0, 5),
                 "relax_dwell_s": fdp.ConsumeFloatInRange(0, 30),
                 "cooldown_s": fdp.ConsumeFloatInRange(0, 5)}
    try:
        settings = PolicySettings(**durations, max_hints_per_window=fdp.ConsumeIntInRange(1, 50))
    except ValueError:      # only a duration under its floor (not 0) is refused
        assert any(0 < v < DURATIONS[k][0] for k, v in durations.items()), durations
        return
    policy = HintPolicy(settings)
    book = HintBook(["gpu0", "gpu1"], ["vision", "text"])
    for _ in range(fdp.ConsumeIntInRange(0, 40)):
        what = fdp.ConsumeIntInRange(0, 4)
        word = fdp.ConsumeUnicodeNoSurrogates(12)
        if what == 0:
            kind, name = fdp.PickValueInList(SERIES)
            value = fdp.ConsumeIntInRange(0, 1 << 22) if fdp.ConsumeBool() else word
            alarm = {"detector": "p99_drift", "series": name.format(value),
                     "state": fdp.PickValueInList(STATES),
                     "evidence": {"p99": fdp.ConsumeFloatInRange(1e-9, 3600),
                                  "baseline": fdp.ConsumeFloatInRange(1e-9, 3600)}}
            shape = fdp.ConsumeIntInRange(0, 3)      # a key as ingest makes it, none, or odd
            if shape == 0:
                alarm["key"] = {"kind": kind, "series": "e2e", "modality": value} \
                    if kind == "request_latency" else {"kind": kind, "pid": value}
            elif shape == 2:
                alarm["key"] = word
            elif shape == 3:
                alarm["key"] = {"kind": kind, "pid": fdp.PickValueInList(ODD_PIDS),
                                "modality": fdp.PickValueInList([value, None, 3])}
            inputs.on_anomaly(alarm)
        elif what == 1:
            inputs.on_anomaly({"detector": "attention_entropy", "kind": word,
                               "modality": fdp.PickValueInList(["vision", "text", word]),
                               "state": fdp.PickValueInList(STATES), "evidence": {}})
        elif what == 2:
            inputs.on_message(fdp.ConsumeIntInRange(0, 1 << 22) if fdp.ConsumeBool() else None,
                              {"type": "sample", "series": "e2e",
                               "modality": fdp.PickValueInList(["vision", "text", word])})
        elif what == 3:
            (PROC / "stat").write_bytes(fdp.ConsumeBytes(64))
        now[0] += fdp.ConsumeIntInRange(0, 5 * 10**9)
        obs = inputs.observations()
        if fdp.ConsumeBool():
            obs.device_weights = {"0": fdp.ConsumeFloatInRange(0, 2),
                                  "1": fdp.ConsumeFloatInRange(0, 2)}
        for hint in policy.decide(obs):
            json.dumps(hint, allow_nan=False)
            assert hint["ttl_s"] > 0 and hint["issued_ns"] == now[0]
            try:
                book.apply(hint, now[0])
            except ValueError:
                assert hint["kind"] in ("degrade", "prefer_device", "modality_batch", "priority")
        assert obs.cpu_utilisation is None or 0 <= obs.cpu_utilisation <= 1


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
