"""The dispatcher's parts on their own, with time passed in: batch order
and its starvation bound, batch formation against the maximum wait,
placement by weight, affinity and its override, hints and their TTL, and
the messages sent to the agent."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmtrace.agent.socket.hint_protocol import validate
from mmtrace.dispatch import messages
from mmtrace.dispatch.batching import ModalityQueue, Request
from mmtrace.dispatch.hints import MAX_TTL_S, HintBook
from mmtrace.dispatch.order import BatchOrder
from mmtrace.dispatch.placement import Placement
from mmtrace.dispatch.queue_config import DEFAULT_QUEUES, parse_queues

MS = 1_000_000


# ---------------------------------------------------------------- queue settings

def test_defaults_are_the_designs():
    q = parse_queues(None)
    assert q["vision"].as_dict() == {"batch_max": 8, "wait_ms": 200.0, "priority": "high"}
    assert q["text"].as_dict() == {"batch_max": 1, "wait_ms": 30.0, "priority": "urgent"}
    assert q["text"].rank < q["vision"].rank


def test_overrides_merge_and_new_modalities_start_plain():
    q = parse_queues({"vision": {"wait_ms": 50}, "audio": {"priority": "normal"}})
    assert q["vision"].as_dict() == {"batch_max": 8, "wait_ms": 50.0, "priority": "high"}
    assert q["audio"].as_dict() == {"batch_max": 1, "wait_ms": 0.0, "priority": "normal"}
    assert DEFAULT_QUEUES["vision"]["wait_ms"] == 200


@pytest.mark.parametrize("overrides, words", [
    ({"text": {"batch_max": 0}}, "batch_max as an integer in 1..4096, got 0"),
    ({"text": {"priority": "asap"}}, "priority one of ['urgent', 'high', 'normal', 'low'], got 'asap'"),
    ({"text": {"wait_ms": float("nan")}}, "wait_ms: expected 0 or a number of milliseconds in 0.001..60000, got nan"),
    ({"text": {"batch": 2}}, "expected keys among ['batch_max', 'priority', 'wait_ms'], got ['batch']"),
    ({"text": 3}, "queues['text']: expected a dict, got int"),
    ([1], "expected a dict of modality -> settings, got list"),
])
def test_bad_overrides_name_what_was_expected(overrides, words):
    with pytest.raises(ValueError) as err:
        parse_queues(overrides)
    assert words in str(err.value)


# ---------------------------------------------------------------- batch order

def test_urgent_goes_first_and_oldest_first_among_equals():
    order = BatchOrder()
    assert order.pick([("vision", 1, 10), ("text", 0, 20)]) == "text"
    assert order.pick([("a", 1, 30), ("b", 1, 20)]) == "b"
    assert order.pick([]) is None


def test_high_is_served_after_the_starvation_limit():
    order = BatchOrder(starvation_limit=3)
    picks = [order.pick([("vision", 1, 0), ("text", 0, i)]) for i in range(8)]
    assert picks == ["text", "text", "text", "vision", "text", "text", "text", "vision"]


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 6), ranks=st.lists(st.integers(0, 3), min_size=2, max_size=5),
       arrivals=st.lists(st.sets(st.integers(0, 4)), min_size=1, max_size=120))
def test_a_ready_queue_waits_behind_a_bounded_number_of_batches(limit, ranks, arrivals):
    """A queue stays ready from its arrival until picked. Without a starving
    queue the best rank wins; no ready queue is passed over more than
    limit + n - 1 times, and with two queues more than `limit` times."""
    n = len(ranks)
    order = BatchOrder(starvation_limit=limit)
    ready_since: dict[int, int] = {}
    passes: dict[int, int] = {}
    for step, arrived in enumerate(arrivals):
        for q in arrived:
            if q < n and q not in ready_since:
                ready_since[q] = step
                passes[q] = 0
        if not ready_since:
            continue
        ready = [(str(q), ranks[q], since) for q, since in ready_since.items()]
        starving = any(passes[q] >= limit for q in ready_since)
        choice = int(order.pick(ready))
        if not starving:
            assert ranks[choice] == min(ranks[q] for q in ready_since)
        del ready_since[choice], passes[choice]
        for q in ready_since:
            passes[q] += 1
            assert passes[q] <= limit + n - 1
            if n == 2:
                assert passes[q] <= limit


# ---------------------------------------------------------------- batch formation

def _request(ts):
    return Request(item=ts, modality="vision", session=None, device="d", submitted_ns=ts)


@settings(max_examples=300, deadline=None)
@given(batch_max=st.integers(1, 8), wait_ms=st.integers(0, 50),
       gaps_ms=st.lists(st.integers(0, 40), min_size=1, max_size=60))
def test_batches_form_until_full_or_the_oldest_has_waited(batch_max, wait_ms, gaps_ms):
    """Event-driven run with an idle device: at each arrival and at each
    deadline the ready batch is taken. No request waits past wait_ms, no
    batch exceeds batch_max, and a short batch leaves only at its deadline."""
    wait_ns = wait_ms * MS
    queue = ModalityQueue("vision")
    arrivals, t = [], 0
    for gap in gaps_ms:
        t += gap * MS
        arrivals.append(t)
    batches = []

    def take_ready(now):
        while queue.ready(now, batch_max, wait_ns):
            oldest = queue.oldest_ns()
            batch = queue.take(batch_max)
            batches.append((now, oldest, [r.submitted_ns for r in batch]))

    for ts in arrivals:
        due = queue.deadline_ns(wait_ns)
        while due is not None and due <= ts:
            take_ready(due)
            due = queue.deadline_ns(wait_ns)
        queue.push(_request(ts))
        take_ready(ts)
    while len(queue):
        take_ready(queue.deadline_ns(wait_ns))

    assert sorted(ts for _, _, b in batches for ts in b) == arrivals
    for taken_at, oldest, batch in batches:
        assert 1 <= len(batch) <= batch_max
        assert taken_at - oldest <= wait_ns
        if len(batch) < batch_max:
            assert taken_at - oldest == wait_ns


def test_full_batch_is_ready_at_once_and_a_short_one_at_its_deadline():
    q = ModalityQueue("vision")
    for i in range(3):
        q.push(_request(i * MS))
    assert not q.ready(5 * MS, 8, 200 * MS)
    assert q.deadline_ns(200 * MS) == 200 * MS
    assert q.ready(200 * MS, 8, 200 * MS)
    for i in range(5):
        q.push(_request(10 * MS))
    assert q.ready(10 * MS, 8, 200 * MS)
    assert [r.submitted_ns for r in q.take(8)] == [0, MS, 2 * MS] + [10 * MS] * 5


# ---------------------------------------------------------------- placement

def test_weights_decide_the_share_and_zero_leaves_a_device_out():
    p = Placement(["a", "b", "c"])
    picks = [p.place(None, {"a": 3, "b": 1, "c": 0}) for _ in range(400)]
    assert picks.count("a") == 300 and picks.count("b") == 100 and picks.count("c") == 0


def test_without_weights_every_device_gets_its_turn():
    p = Placement(["a", "b", "c"])
    picks = [p.place(None, {}) for _ in range(9)]
    assert sorted(picks[:3]) == ["a", "b", "c"] and picks[:3] * 3 == picks


def test_all_weights_zero_falls_back_to_every_candidate():
    p = Placement(["a", "b"])
    assert {p.place(None, {"a": 0, "b": 0}) for _ in range(4)} == {"a", "b"}


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.integers(1, 10), min_size=2, max_size=5), rounds=st.integers(1, 5))
def test_weighted_share_is_exact_over_whole_rounds(weights, rounds):
    devices = [f"d{i}" for i in range(len(weights))]
    p = Placement(devices)
    w = dict(zip(devices, weights))
    picks = [p.place(None, w) for _ in range(sum(weights) * rounds)]
    assert {d: picks.count(d) for d in devices} == {d: w[d] * rounds for d in devices}


def test_a_session_stays_on_its_device_whatever_the_weights():
    p = Placement(["a", "b"])
    first = p.place("s1", {"a": 1, "b": 1})
    heavy = {"a": 0.0, "b": 0.0, first: 1.0}
    other = "b" if first == "a" else "a"
    heavy[other] = 1000.0
    assert all(p.place("s1", heavy) == first for _ in range(20))
    p.load[first] = 100
    assert p.place("s1", {}) == first            # its state is there: no override
    assert p.forget("s1") and not p.forget("s1")


def test_imbalance_override_needs_both_the_absolute_and_the_relative_gap():
    p = Placement(["a", "b"], imbalance_abs=8, imbalance_rel=2.0)
    only_a = {"a": 1.0, "b": 0.0}
    p.load.update(a=9, b=2)                      # 7 apart: below the absolute gap
    assert p.place("s1", only_a) == "a"
    p.load.update(a=20, b=11)                    # 9 apart, but less than twice
    assert p.place("s2", only_a) == "a"
    p.load.update(a=20, b=10)                    # 10 apart and twice as many
    assert p.place("s3", only_a) == "b" and p.overrides == 1
    assert p.place("s1", only_a) == "a"          # placed sessions stay


def test_route_restricts_new_work_to_its_devices():
    p = Placement(["a", "b", "c"])
    assert {p.place(None, {}, ["c"]) for _ in range(5)} == {"c"}


def test_session_memory_is_bounded():
    p = Placement(["a", "b"], max_sessions=10)
    for s in range(50):
        p.place(s, {})
    assert len(p.sessions) == 10 and 49 in p.sessions and 0 not in p.sessions


# ---------------------------------------------------------------- hints

def hint(kind, target, value, ttl_s=1.0, **extra):
    return {"v": 1, "type": "hint", "id": f"{kind}-{target}", "kind": kind, "target": target,
            "value": value, "ttl_s": ttl_s, "reason": "test", "evidence": {"p99": 1},
            "issued_ns": 1, **extra}


def book():
    return HintBook(["gpu0", "gpu1"], ["vision", "text"])


def test_each_kind_changes_its_effect_and_expires():
    b = book()
    b.apply(hint("modality_batch", "vision", 4), 0)
    b.apply(hint("priority", "vision", "urgent", ttl_s=2), 0)
    b.apply(hint("route_affinity", "text", ["gpu1"]), 0)
    b.apply(hint("prefer_device", "*", {"gpu0": 3, "1": 1}), 0)
    b.apply(hint("degrade", "*", 1), 0)
    b.apply(hint("cpu_contention", "runq_delay{pid=7}", 3.5), 0)
    fx = b.effects
    assert fx.batch_cap == {"vision": 4} and fx.priority == {"vision": "urgent"}
    assert fx.routes == {"text": ["gpu1"]} and fx.weights == {"gpu0": 3.0, "gpu1": 1.0}
    assert fx.degraded("vision") and fx.degraded("text") and fx.cpu_contention
    assert len(b.views(0)) == 6 and b.next_expiry_ns == 1_000_000_000
    assert not b.expire(999_999_999)
    assert b.expire(1_000_000_000)
    assert b.effects.priority == {"vision": "urgent"} and not b.effects.batch_cap
    assert b.expire(2_000_000_000)
    assert b.effects == type(b.effects)() and b.next_expiry_ns is None and b.expired == 6


def test_a_newer_hint_of_the_same_kind_and_target_replaces_the_older():
    b = book()
    b.apply(hint("modality_batch", "vision", 4, ttl_s=10), 0)
    b.apply(hint("modality_batch", "vision", 2, ttl_s=1), 5)
    assert b.effects.batch_cap == {"vision": 2} and len(b.active) == 1
    assert b.expire(1_000_000_005) and b.effects.batch_cap == {}


def test_device_weight_hints_combine_and_devices_no_hint_names_weigh_one():
    b = HintBook(["a", "b", "c"], ["text"])
    b.apply(hint("prefer_device", "a", 5), 0)
    b.apply(hint("prefer_device", "b", 0), 0)
    assert b.effects.weights == {"a": 5.0, "b": 0.0, "c": 1.0}


def test_a_refused_replacement_keeps_the_hint_it_would_have_replaced():
    b = book()
    b.apply(hint("prefer_device", "gpu1", 0), 0)
    b.apply(hint("prefer_device", "gpu0", 2), 0)
    with pytest.raises(ValueError, match="at least one device with a weight above 0"):
        b.apply(hint("prefer_device", "gpu0", 0), 0)
    assert b.effects.weights == {"gpu0": 2.0, "gpu1": 0.0} and len(b.active) == 2


def test_an_expiry_that_leaves_every_weight_at_zero_is_not_an_error():
    b = book()
    b.apply(hint("prefer_device", "gpu1", 0, ttl_s=10), 0)
    b.apply(hint("prefer_device", "*", {"gpu0": 0, "gpu1": 4}, ttl_s=1), 0)
    b.apply(hint("prefer_device", "gpu0", 0, ttl_s=10), 0)
    assert b.effects.weights == {"gpu0": 0.0, "gpu1": 4.0}
    assert b.expire(1_000_000_000)
    assert b.effects.weights == {"gpu0": 0.0, "gpu1": 0.0}
    p = Placement(["gpu0", "gpu1"])
    assert {p.place(None, b.effects.weights) for _ in range(4)} == {"gpu0", "gpu1"}


def test_the_longest_ttl_is_held_and_a_longer_one_refused():
    b = book()
    h = b.apply(hint("degrade", "text", 1, ttl_s=MAX_TTL_S), 0)
    assert h.ttl_s == MAX_TTL_S and h.expires_ns == int(MAX_TTL_S * 1e9)
    with pytest.raises(ValueError, match=r"degrade hint ttl_s: expected a number of seconds in "
                                         r"0\.001\.\.3600, got 3600\.5"):
        b.apply(hint("degrade", "text", 1, ttl_s=MAX_TTL_S + 0.5), 0)


@pytest.mark.parametrize("message, words", [
    ({**hint("priority", "text", "high"), "v": "1"}, "expected \"v\": 1, got '1'"),
    ({**hint("priority", "text", "high"), "type": "sample"}, "expected \"type\": \"hint\""),
    (hint("reroute", "text", 1), "expected kind one of"),
    (hint("priority", "text", "high", ttl_s=0), "ttl_s: expected a number of seconds in 0.001..3600, got 0"),
    (hint("priority", "text", "high", ttl_s=float("inf")), "ttl_s: expected a number of seconds"),
    (hint("priority", "audio", "high"), "expected target one of ['vision', 'text'], got 'audio'"),
    (hint("priority", "text", "now"), "priority hint value: expected priority one of"),
    (hint("priority", "text", ["high"]), "got ['high']"),
    (hint("modality_batch", "vision", 0), "batch_max as an integer in 1..4096, got 0"),
    (hint("modality_batch", "vision", 2.5), "got 2.5"),
    (hint("route_affinity", "text", []), "a device name or a non-empty list, got []"),
    (hint("route_affinity", "text", "gpu7"), "expected a device among ['gpu0', 'gpu1'] or its ordinal, got 'gpu7'"),
    (hint("prefer_device", "*", {"gpu0": -1}), "prefer_device weight of gpu0: expected a number in 0..1e+06, got -1"),
    (hint("prefer_device", "*", {"gpu0": 0, "gpu1": 0}), "at least one device with a weight above 0"),
    (hint("prefer_device", "*", 3), "expected value {device: weight}"),
    (hint("degrade", "text", 9), "integer level 0..3, got 9"),
    (hint("degrade", "text", True), "got True"),
    (hint("cpu_contention", "", 1), "expected target a non-empty string"),
    (hint("cpu_contention", "t", float("nan")), "cpu_contention hint value: expected a number"),
    ("hint", "expected a JSON object, got str"),
])
def test_a_bad_hint_is_refused_by_name_and_changes_nothing(message, words):
    b = book()
    b.apply(hint("modality_batch", "vision", 4), 0)
    before = (b.effects, list(b.active))
    with pytest.raises(ValueError) as err:
        b.apply(message, 0)
    assert words in str(err.value)
    assert (b.effects, list(b.active)) == before and b.applied == 1


def test_hint_count_is_bounded():
    b = book()
    for i in range(1000):
        b.apply(hint("cpu_contention", f"series{i}", 1.0, ttl_s=1 + i), 0)
    assert len(b.active) == 256
    assert ("cpu_contention", "series999") in b.active and ("cpu_contention", "series0") not in b.active


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["modality_batch", "priority", "degrade"]),
                          st.sampled_from(["vision", "text"]),
                          st.integers(1, 5), st.integers(1, 5000)), max_size=30),
       st.integers(0, 6000))
def test_after_every_ttl_the_book_is_back_on_defaults(applied, later_ms):
    b = book()
    values = {"modality_batch": lambda v: v, "priority": lambda v: ["urgent", "high", "normal", "low"][v % 4],
              "degrade": lambda v: v % 2}
    for i, (kind, target, v, ttl_ms) in enumerate(applied):
        b.apply(hint(kind, target, values[kind](v), ttl_s=ttl_ms / 1000), i * MS)
    b.expire(later_ms * MS)
    assert all(h.expires_ns > later_ms * MS for h in b.active.values())
    b.expire((len(applied) + 5001) * MS)
    assert not b.active and b.effects == type(b.effects)()


# ---------------------------------------------------------------- messages

def test_the_limits_are_the_agents():
    from mmtrace.agent.socket import hint_protocol
    for name in ("MAX_MESSAGE", "MAX_NAME", "MAX_VALUES", "MAX_HEAD", "MAX_VALUE_MS"):
        assert getattr(messages, name) == getattr(hint_protocol, name), name


def test_sample_follows_the_schema_strictly():
    msg = messages.sample("e2e", "text", 12, 123)
    assert msg == {"v": 1, "type": "sample", "series": "e2e", "modality": "text", "value_ms": 12.0,
                   "ts_ns": 123}
    assert type(msg["v"]) is int and type(msg["value_ms"]) is float and type(msg["ts_ns"]) is int
    assert validate(json.loads(messages.encode(msg))) == msg
    for bad in (-0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite number >= 0"):
            messages.sample("e2e", "text", bad, 1)


entropy_sample = st.fixed_dictionaries({
    "layer": st.one_of(st.text(max_size=300), st.integers()),
    "head": st.one_of(st.integers(0, 64), st.booleans(), st.none()),
    "value": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2)),
    "modality": st.one_of(st.none(), st.sampled_from(["vision", "text"])),
})


@settings(max_examples=150, deadline=None)
@given(st.lists(entropy_sample, max_size=1500))
def test_entropy_messages_are_valid_bounded_and_lose_nothing_usable(samples):
    built, unusable = messages.entropy(samples)
    usable = [s for s in samples if messages.entropy_value(s) is not None]
    assert unusable == len(samples) - sum(len(m["values"]) for m in built)
    assert sum(len(m["values"]) for m in built) == len(usable)
    for m in built:
        line = messages.encode(m)
        assert len(line) <= messages.MAX_MESSAGE
        # the agent takes it whole, and hands each sample on with its modality
        assert validate(json.loads(line)) == {
            **m, "values": [{**v, "modality": m["modality"]} for v in m["values"]]}
        assert all(0.0 <= v["value"] <= 1.0 and type(v["head"]) is int for v in m["values"])


def test_entropy_of_many_long_layer_names_splits_into_messages():
    samples = [{"layer": "encoder.layers.%d.self_attn" % i + "x" * 200, "head": h, "value": 0.5,
                "modality": "vision"} for i in range(48) for h in range(16)]
    built, unusable = messages.entropy(samples)
    assert unusable == 0 and len(built) > 1
    assert sum(len(m["values"]) for m in built) == len(samples)
