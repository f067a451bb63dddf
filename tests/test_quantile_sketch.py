"""The sketch's relative-error bound, merging, bad input and bounded memory."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmtrace.detectors.quantile_sketch import LogMapping, QuantileSketch, quantile_columns

QUANTILES = (0.0, 0.01, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0)
# log() rounding can put a value sitting exactly on a bucket edge into the
# neighbouring bucket, whose representative is then alpha away plus ulps.
ROUNDING_SLACK = 1e-9


def assert_within_bound(sketch: QuantileSketch, values: np.ndarray, quantiles=QUANTILES) -> None:
    for q in quantiles:
        exact = float(np.quantile(values, q, method="lower"))
        estimate = sketch.quantile(q)
        if exact == 0.0:
            assert estimate == 0.0, f"q={q}: exact 0, sketch {estimate}"
        else:
            error = abs(estimate - exact) / exact
            assert error <= sketch.alpha + ROUNDING_SLACK, f"q={q}: exact {exact}, sketch {estimate}, error {error}"


DISTRIBUTIONS = {
    "lognormal_sigma1_seconds": lambda rng, n: rng.lognormal(np.log(1e-3), 1.0, n),
    "lognormal_sigma3": lambda rng, n: rng.lognormal(0.0, 3.0, n),
    "pareto_shape_1_5": lambda rng, n: rng.pareto(1.5, n) + 1.0,
    "exponential_integer_ns_with_zeros": lambda rng, n: np.round(rng.exponential(3.0, n)),
    "uniform": lambda rng, n: rng.uniform(0.0, 1.0, n),
    "bimodal": lambda rng, n: np.where(rng.random(n) < 0.97, rng.normal(100, 5, n).clip(1), rng.normal(5e4, 1e3, n)),
    "mostly_zero_runq_delay": lambda rng, n: np.where(rng.random(n) < 0.9, 0.0, rng.lognormal(10, 2, n)),
}


@pytest.mark.parametrize("alpha", [0.01, 0.05])
@pytest.mark.parametrize("size", [1, 2, 7, 150, 20_000])
@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_quantiles_stay_within_alpha_of_exact_lower_quantile(name, size, alpha):
    for seed in range(4):
        values = DISTRIBUTIONS[name](np.random.default_rng(seed), size)
        sketch = QuantileSketch(alpha=alpha)
        sketch.add_many(values)
        assert sketch.count == size
        assert_within_bound(sketch, values)


normal_floats = st.one_of(st.just(0.0), st.floats(min_value=1e-300, max_value=1e300))


@settings(max_examples=300, deadline=None)
@given(st.lists(normal_floats, min_size=1, max_size=300), st.sampled_from([0.005, 0.01, 0.1]))
def test_bound_holds_for_arbitrary_values_over_600_decades(values, alpha):
    values = np.array(values)
    # Enough buckets for 600 decades, so nothing collapses.
    sketch = QuantileSketch(alpha=alpha, max_buckets=200_000)
    sketch.add_many(values)
    assert not sketch.collapsed
    assert_within_bound(sketch, values)


@settings(max_examples=200, deadline=None)
@given(st.lists(normal_floats, min_size=0, max_size=200), st.lists(normal_floats, min_size=0, max_size=200))
def test_merge_equals_one_sketch_over_both_inputs(left, right):
    merged, a, b = QuantileSketch(), QuantileSketch(), QuantileSketch()
    a.add_many(np.array(left))
    b.add_many(np.array(right))
    merged.add_many(np.array(left + right))
    a.merge(b)
    assert a.count == merged.count
    assert a.quantiles(QUANTILES) == merged.quantiles(QUANTILES)


def test_batches_and_one_shot_give_identical_sketches():
    values = np.random.default_rng(3).lognormal(0, 2, 10_000)
    one_shot, batched = QuantileSketch(), QuantileSketch()
    one_shot.add_many(values)
    for part in np.array_split(values, 37):
        batched.add_many(part)
    assert batched.quantiles(QUANTILES) == one_shot.quantiles(QUANTILES)
    assert batched.bucket_count == one_shot.bucket_count


def test_nan_inf_and_negative_are_rejected_and_counted_zero_is_kept():
    sketch = QuantileSketch()
    sketch.add_many(np.array([np.nan, np.inf, -np.inf, -1.0, 0.0, 0.0, 5.0]))
    assert sketch.rejected == 4
    assert sketch.count == 3
    assert sketch.zero_count == 2
    assert sketch.quantile(0.0) == 0.0
    assert sketch.quantile(0.5) == 0.0
    assert sketch.quantile(1.0) == pytest.approx(5.0, rel=0.01)
    assert (sketch.min, sketch.max) == (0.0, 5.0)


def test_integer_nanoseconds_are_accepted():
    sketch = QuantileSketch()
    sketch.add_many(np.arange(1, 1001, dtype=np.int64))
    assert sketch.quantile(0.99) == pytest.approx(990, rel=0.01)


def test_empty_sketch_has_no_quantile():
    assert QuantileSketch().quantile(0.99) is None
    only_bad = QuantileSketch()
    only_bad.add_many(np.array([np.nan]))
    assert only_bad.quantile(0.5) is None and only_bad.rejected == 1


def test_memory_is_bounded_by_collapsing_the_lowest_buckets():
    rng = np.random.default_rng(5)
    high = rng.lognormal(0.0, 0.1, 10_000)  # spans about 50 buckets at alpha 0.01
    low = np.logspace(-300, -1, 50)  # 0.5 % of the values, far below
    values = np.concatenate([low, high])
    sketch = QuantileSketch(alpha=0.01, max_buckets=200)
    for part in np.array_split(rng.permutation(values), 10):
        sketch.add_many(part)
    assert sketch.bucket_count <= 200
    assert sketch.collapsed
    assert sketch.count == values.size
    # Quantiles above the collapsed region keep the guarantee.
    assert_within_bound(sketch, values, quantiles=(0.1, 0.5, 0.99, 1.0))
    # A collapsed low quantile is reported at the lowest kept bucket, no lower.
    assert sketch.quantile(0.001) > np.quantile(values, 0.001, method="lower")


def test_merge_respects_the_bucket_cap():
    a, b = QuantileSketch(max_buckets=64), QuantileSketch(max_buckets=64)
    a.add_many(np.array([1e-200, 1.0]))
    b.add_many(np.array([1e200]))
    a.merge(b)
    assert a.bucket_count <= 64 and a.collapsed and a.count == 3
    assert a.quantile(1.0) == 1e200


def test_merging_different_alphas_names_both():
    with pytest.raises(ValueError, match=r"0\.01.*0\.05"):
        QuantileSketch(alpha=0.01).merge(QuantileSketch(alpha=0.05))


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, float("nan"), "0.01"])
def test_bad_alpha_is_refused_with_what_arrived(alpha):
    with pytest.raises(ValueError, match="alpha must be"):
        QuantileSketch(alpha=alpha)


@pytest.mark.parametrize("q", [-0.1, 1.01, float("nan")])
def test_bad_quantile_is_refused(q):
    sketch = QuantileSketch()
    sketch.add(1.0)
    with pytest.raises(ValueError, match=r"quantile must be a number in \[0, 1\]"):
        sketch.quantile(q)


def test_mapping_representatives_are_within_alpha_of_every_bucket_member():
    mapping = LogMapping(0.02)
    edges = mapping.gamma ** np.arange(-50, 50, dtype=np.float64)
    inside = np.concatenate([edges, edges * 1.0001, edges * (mapping.gamma - 1e-9)])
    representative = mapping.value(mapping.index(inside))
    assert np.all(np.abs(representative - inside) / inside <= 0.02 + ROUNDING_SLACK)


def test_quantile_columns_match_per_row_quantiles():
    counts = np.array([[0, 0, 0], [5, 0, 0], [1, 1, 98], [0, 99, 1]])
    column, totals = quantile_columns(counts, 0.99)
    assert totals.tolist() == [0, 5, 100, 100]
    # lower p99 of 100 values is rank 98: in the last column for row 2, the
    # middle one for row 3 (ranks 0..98 sit there).
    assert column.tolist() == [-1, 0, 2, 1]
