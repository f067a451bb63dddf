"""The hint policy: each rule's trigger and relaxation, dwell, cooldown, cap,
TTL refresh, dry-run, and no oscillation under a load that hovers at a
threshold."""

from hypothesis import given, settings
from hypothesis import strategies as st

from mmtrace.dispatch.policy import HintPolicy, Observations, PolicySettings

S = 10**9


def runq(pid, p99=0.004, baseline=0.001):
    return {"detector": "p99_drift", "series": f"runq_delay{{pid={pid}}}", "state": "firing",
            "key": {"kind": "runq_delay", "pid": pid},
            "evidence": {"p99": p99, "baseline": baseline}}


def starved(pid, share=0.46, threshold=0.1, verdict="cpu_starved"):
    """A starvation anomaly as the daemon delivers it (detectors/starvation.py,
    the verdict added by agent/daemon/alarms.py)."""
    return {"detector": "starvation", "kind": "cpu_starved", "state": "firing", "pid": pid,
            "comm": "server", "key": {"kind": "runq_share", "pid": pid},
            "evidence": {"share": share, "threshold": threshold, "baseline": 0.02,
                         "windows": 2, "window_s": 1.0, "verdict": verdict}}


def request(modality, series="e2e"):
    return {"detector": "p99_drift",
            "series": f"request_latency{{series={series},modality={modality}}}",
            "key": {"kind": "request_latency", "series": series, "modality": modality},
            "state": "firing", "evidence": {"p99": 0.3, "baseline": 0.1}}


def entropy(modality):
    return {"detector": "attention_entropy", "kind": "entropy_rise", "state": "firing",
            "modality": modality, "evidence": {"heads": [["enc.0", 3, 0.97]]}}


def kinds(hints):
    return [(h["kind"], h["target"], h["value"]) for h in hints]


def run(policy, seconds, step_s=0.5, start_s=0.0, **obs):
    """decide() every step_s from start_s for `seconds`; all hints sent."""
    out = []
    t = start_s
    while t < start_s + seconds:
        out += policy.decide(Observations(now_ns=int(t * S), **obs))
        t += step_s
    return out


def test_what_a_series_is_about_comes_from_its_key_never_from_its_name():
    """A dispatcher may name its series and modality anything: the name a
    person reads is not parsed, the anomaly's key is what counts."""
    p = HintPolicy()
    tricky = request("x,modality=vision", series="e2e")
    assert tricky["series"] == "request_latency{series=e2e,modality=x,modality=vision}"
    hints = p.decide(Observations(now_ns=0, firing=[tricky], active_modalities={"vision"},
                                  cpu_utilisation=0.1))
    assert [h["target"] for h in hints if h["kind"] == "degrade"] == ["x,modality=vision"]
    named_only = {k: v for k, v in runq(70).items() if k != "key"}
    assert HintPolicy().decide(Observations(now_ns=0, firing=[named_only],
                                            served={70: {"vision"}})) == []


def test_the_policy_names_the_kinds_as_ingest_does():
    """The policy may not import the agent (it runs beside the server's
    code too): its copy of the kinds must match agent/ingest/series_keys.py."""
    from mmtrace.agent.ingest import series_keys
    from mmtrace.dispatch import policy as policy_mod
    assert (policy_mod.RUNQ, policy_mod.REQUEST) == (series_keys.RUNQ, series_keys.REQUEST)


def test_runq_drift_of_a_vision_server_steps_its_batches_down_fast_and_back_slowly():
    p = HintPolicy(PolicySettings(escalate_dwell_s=2, relax_dwell_s=20, cooldown_s=1, ttl_s=600))
    first = p.decide(Observations(now_ns=0, firing=[runq(70)], served={70: {"vision"}}))
    assert kinds(first) == [("modality_batch", "vision", 4), ("cpu_contention", "pid=70", 4.0)]
    assert first[0]["ttl_s"] == 600 and "pid 70" in first[0]["reason"]
    assert first[0]["evidence"] == {"p99": 0.004, "baseline": 0.001}
    held = run(p, 5, start_s=0.5, firing=[runq(70)], served={70: {"vision"}})
    assert kinds(held) == [("modality_batch", "vision", 2)]           # after 2 s more
    assert held[0]["issued_ns"] == 2 * S
    calm = run(p, 60, start_s=5.5, served={70: {"vision"}})
    assert kinds(calm) == [("modality_batch", "vision", 4), ("modality_batch", "vision", 8)]
    assert [h["issued_ns"] for h in calm] == [int(25.5 * S), int(45.5 * S)]


def test_the_policy_names_the_starvation_detectors_key_and_verdict():
    """Its copy of the starvation detector's key kind and of the verdict
    that says more CPU would help."""
    from mmtrace.detectors.diagnosis import VERDICTS
    from mmtrace.detectors.starvation import Starvation
    from mmtrace.dispatch import policy as policy_mod
    detector = Starvation(consecutive=1)
    [record] = detector.observe(10**9, {7: (0.9, 1.0, "server")})
    assert record["key"] == {"kind": policy_mod.RUNQ_SHARE, "pid": 7}
    assert record["kind"] == policy_mod.CPU_STARVED and policy_mod.CPU_STARVED in VERDICTS


def test_a_starved_launcher_presses_as_its_run_queue_drift_does():
    """The starvation detector's anomaly moves the same levers as a run-queue
    P99 drift of that process; cpu_contention carries the share over its
    threshold and the evidence."""
    p = HintPolicy(PolicySettings(ttl_s=600))
    hints = p.decide(Observations(now_ns=0, firing=[starved(70)],
                                  served={70: {"vision", "text"}}))
    assert kinds(hints) == [("modality_batch", "vision", 4), ("priority", "vision", "low"),
                            ("cpu_contention", "pid=70", 4.6)]
    assert "pid 70" in hints[0]["reason"] and "46%" in hints[0]["reason"]
    assert hints[2]["evidence"]["verdict"] == "cpu_starved"
    # both alarms of one process: one cpu_contention, not two
    both = HintPolicy().decide(Observations(now_ns=0, firing=[runq(70), starved(70)],
                                            served={70: {"vision"}}))
    assert kinds(both) == [("modality_batch", "vision", 4), ("cpu_contention", "pid=70", 4.0)]
    # two starved processes: each its hint
    two = HintPolicy().decide(Observations(now_ns=0, firing=[starved(70), starved(71)]))
    assert [h["target"] for h in two] == ["pid=70", "pid=71"]


def test_a_cpu_alarm_whose_verdict_names_another_bound_presses_nothing():
    """A launcher that waits for its copies (bus_bound) or its device gets
    nothing from CPU hints, whichever detector fired; without a verdict the
    alarm speaks for itself."""
    for other in ("bus_bound", "device_bound", "host_bound", "healthy"):
        p = HintPolicy()
        drift = runq(70)
        drift["evidence"]["verdict"] = other
        firing = [starved(70, verdict=other), drift]
        assert p.decide(Observations(now_ns=0, firing=firing,
                                     served={70: {"vision", "text"}})) == [], other
        assert p.contention == {}
    # the same alarms, starved: they press; with no verdict: too
    p = HintPolicy()
    drift = runq(71)
    drift["evidence"]["verdict"] = "cpu_starved"
    assert kinds(p.decide(Observations(now_ns=0, firing=[drift], served={71: {"text"}}))) == [
        ("priority", "vision", "low"), ("cpu_contention", "pid=71", 4.0)]
    assert kinds(HintPolicy().decide(Observations(now_ns=0, firing=[runq(72)]))) == [
        ("cpu_contention", "pid=72", 4.0)]
    # a bus-bound process's alarm does not keep another's lever pressed: it relaxes
    p = HintPolicy(PolicySettings(relax_dwell_s=5, cooldown_s=1, ttl_s=600))
    run(p, 1, firing=[starved(70)], served={70: {"vision"}})
    calm = run(p, 10, start_s=1, firing=[starved(70, verdict="bus_bound")],
               served={70: {"vision"}})
    assert kinds(calm) == [("modality_batch", "vision", 8)]


def test_runq_drift_of_a_text_server_lowers_vision_priority():
    p = HintPolicy()
    hints = p.decide(Observations(now_ns=0, firing=[runq(71)], served={71: {"text"}}))
    assert ("priority", "vision", "low") in kinds(hints)
    assert not any(k == "modality_batch" for k, _, _ in kinds(hints))


def test_text_p99_drift_shrinks_vision_batches_only_while_vision_is_in_flight():
    p = HintPolicy()
    assert kinds(p.decide(Observations(now_ns=0, firing=[request("text")], cpu_utilisation=0.9,
                                       active_modalities={"text"}))) == []
    hints = p.decide(Observations(now_ns=S, firing=[request("text")], cpu_utilisation=0.9,
                                  active_modalities={"text", "vision"}))
    assert kinds(hints) == [("modality_batch", "vision", 4)]


def test_end_to_end_drift_with_idle_cpu_degrades_that_modality():
    p = HintPolicy()
    busy = p.decide(Observations(now_ns=0, firing=[request("text")], cpu_utilisation=0.8))
    assert kinds(busy) == []
    idle = p.decide(Observations(now_ns=S, firing=[request("text")], cpu_utilisation=0.3))
    assert kinds(idle) == [("degrade", "text", 1)]
    assert idle[0]["evidence"]["cpu_utilisation"] == 0.3
    assert "30%" in idle[0]["reason"]


def test_entropy_drift_degrades_its_modality_with_the_evidence():
    p = HintPolicy()
    [hint] = p.decide(Observations(now_ns=0, firing=[entropy("vision")]))
    assert (hint["kind"], hint["target"], hint["value"]) == ("degrade", "vision", 1)
    # the modality rides in the evidence: the agent sends it to that modality's reporters
    assert hint["evidence"] == {"heads": [["enc.0", 3, 0.97]], "entropy_modality": "vision"}


def test_device_weights_are_sent_when_they_move_and_refreshed_before_the_ttl():
    p = HintPolicy(PolicySettings(ttl_s=10))
    w = {"0": 0.9, "1": 0.2}
    assert kinds(p.decide(Observations(now_ns=0, device_weights=w))) == \
        [("prefer_device", "*", {"0": 0.9, "1": 0.2})]
    assert p.decide(Observations(now_ns=S, device_weights={"0": 0.85, "1": 0.2})) == []
    assert kinds(p.decide(Observations(now_ns=2 * S, device_weights={"0": 0.5, "1": 0.2})))
    assert p.decide(Observations(now_ns=6 * S, device_weights={"0": 0.5, "1": 0.2})) == []
    refresh = p.decide(Observations(now_ns=7 * S, device_weights={"0": 0.5, "1": 0.2}))
    assert kinds(refresh) == [("prefer_device", "*", {"0": 0.5, "1": 0.2})]


def test_a_held_lever_is_sent_again_at_half_its_ttl():
    p = HintPolicy(PolicySettings(ttl_s=4, escalate_dwell_s=100))
    hints = run(p, 10, firing=[entropy("text")])
    degrade = [h["issued_ns"] / S for h in hints if h["kind"] == "degrade"]
    assert degrade == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert p.counts[("degrade", "sent")] == 5


def test_the_cap_holds_hints_back_and_logs_them():
    p = HintPolicy(PolicySettings(max_hints_per_window=3, window_s=60))
    firing = [runq(pid) for pid in range(10, 20)]
    sent = p.decide(Observations(now_ns=0, firing=firing))
    assert len(sent) == 3
    capped = [e for e in p.audit if e["outcome"] == "capped"]
    assert len(capped) == 7 and all(e["kind"] == "cpu_contention" for e in capped)
    later = p.decide(Observations(now_ns=61 * S, firing=firing))     # next window: the rest
    assert len(later) == 3


def test_dry_run_sends_nothing_and_logs_everything():
    p = HintPolicy(PolicySettings(dry_run=True))
    hints = p.decide(Observations(now_ns=0, firing=[runq(70), entropy("text")],
                                  served={70: {"vision", "text"}}, device_weights={"0": 1.0}))
    assert hints == []
    logged = {(e["kind"], e["target"]) for e in p.audit}
    assert logged == {("modality_batch", "vision"), ("priority", "vision"), ("degrade", "text"),
                      ("cpu_contention", "pid=70"), ("prefer_device", "*")}
    assert all(e["outcome"] == "dry_run" and e["reason"] for e in p.audit)
    # the levers moved as if sent: a dry run shows what would happen next
    assert p.levers[("modality_batch", "vision")].value == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(0.05, 3.0)), min_size=1, max_size=200))
def test_a_load_hovering_at_the_threshold_does_not_make_levers_oscillate(flips):
    """Pressure on and off at any pace: a lever never relaxes sooner than
    relax_dwell_s after it last moved, never escalates again sooner than
    the cooldown, and never leaves its steps."""
    s = PolicySettings(escalate_dwell_s=2, relax_dwell_s=20, cooldown_s=3, ttl_s=3600,
                       max_hints_per_window=10**6)
    p = HintPolicy(s)
    t = 0.0
    changes = []
    for pressed, duration in flips:
        end = t + duration
        while t < end:
            firing = [request("text")] if pressed else []
            for h in p.decide(Observations(now_ns=int(t * S), firing=firing,
                                           active_modalities={"vision"}, cpu_utilisation=0.9)):
                changes.append((t, h["value"]))
            t += 0.1
    for (t0, v0), (t1, v1) in zip([(0.0, 8)] + changes, changes):
        assert v1 in (2, 4, 8)
        if v1 > v0:                                   # relaxed
            assert t1 - t0 >= s.relax_dwell_s - 1e-6
        elif v0 != 8:                                 # escalated again
            assert t1 - t0 >= max(s.cooldown_s, s.escalate_dwell_s) - 1e-6


def test_a_lever_a_clients_word_moved_steps_back_with_that_word_and_kernel_evidence_wins():
    """What a client's own request latencies raised carries its series (the
    agent sends such a hint to that client only): the steps back too. A
    run-queue alarm pressing the same lever makes its hints everyone's."""
    from mmtrace.dispatch.policy import client_scoped
    p = HintPolicy(PolicySettings(escalate_dwell_s=2, relax_dwell_s=5, cooldown_s=1, ttl_s=10))
    pressed = run(p, 4, firing=[request("text")], active_modalities={"vision"},
                  cpu_utilisation=0.9)
    assert [h["value"] for h in pressed if h["kind"] == "modality_batch"] == [4, 2]
    assert all(client_scoped(h["evidence"]) for h in pressed)
    relaxed = run(p, 12, start_s=4, active_modalities={"vision"}, cpu_utilisation=0.9)
    steps = [h for h in relaxed if h["kind"] == "modality_batch"]
    # a refresh of 2 at half its TTL, then a step back every 5 s calm
    assert [h["value"] for h in steps] == [2, 4, 8] and all(client_scoped(h["evidence"])
                                                            for h in steps)
    q = HintPolicy(PolicySettings(escalate_dwell_s=2, relax_dwell_s=5, cooldown_s=1, ttl_s=4))
    run(q, 4, firing=[request("text")], active_modalities={"vision"}, cpu_utilisation=0.9)
    both = run(q, 6, start_s=4, firing=[request("text"), runq(70)], served={70: {"vision"}},
               active_modalities={"vision"}, cpu_utilisation=0.9)
    refreshed = [h for h in both if h["kind"] == "modality_batch"]
    assert refreshed and not any(client_scoped(h["evidence"]) for h in refreshed)


def test_a_starved_launcher_that_is_also_device_bound_still_gets_cpu_hints():
    """The verdict names the largest cause; CPU hints follow starvation
    wherever it is among the causes."""
    from mmtrace.dispatch.policy import _cpu_pid
    alarm = {"state": "firing", "key": {"kind": "runq_share", "pid": 70},
             "evidence": {"share": 0.3, "threshold": 0.12, "verdict": "device_bound",
                          "causes": ["device_bound", "cpu_starved"]}}
    assert _cpu_pid(alarm) == 70
    alarm["evidence"]["causes"] = ["device_bound"]
    assert _cpu_pid(alarm) is None
