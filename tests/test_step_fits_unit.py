"""adaptive/step_fits.py: the pure fits the batch policy's step times take
(the weighted cost line, the clipped mean, the Theil-Sen batch exponent),
each against values worked out by hand."""
import math

import pytest

from vllm_specplug.adaptive.step_fits import clipped_mean, theil_sen_exponent, weighted_line


def test_weighted_line_recovers_an_exact_line_and_weighs_its_points():
    line = weighted_line([(1, 3.0, 1), (2, 5.0, 4), (5, 11.0, 2)])  # y = 1 + 2x
    assert line == pytest.approx((1.0, 2.0))
    # two points off the line: the heavier one pulls the fit to itself
    light = weighted_line([(0, 0.0, 1), (1, 1.0, 1), (2, 4.0, 1)])
    heavy = weighted_line([(0, 0.0, 1), (1, 1.0, 1), (2, 4.0, 10)])
    assert heavy[0] + 2 * heavy[1] > light[0] + 2 * light[1]


def test_weighted_line_needs_two_lengths_and_never_falls():
    assert weighted_line([(3, 1.0, 5), (3, 2.0, 5)]) is None  # one distinct K
    assert weighted_line([]) is None
    intercept, slope = weighted_line([(1, 5.0, 1), (4, 2.0, 1)])  # falling: held flat
    assert slope == 0.0 and intercept == pytest.approx(3.5)


def test_clipped_mean_drops_stalls_and_early_intervals():
    times = sorted([1.0, 1.0, 1.2, 0.2, 5.0])  # median 1.0; 0.2 and 5.0 outside [1/3, 3]
    assert clipped_mean(times, 3.0) == pytest.approx(3.2 / 3)
    assert clipped_mean(times, 10.0) == pytest.approx(8.4 / 5)


def test_theil_sen_exponent_reads_the_slope_of_log_time_over_log_batch():
    # time ~ batch ** 0.5 at K=1 and K=3 in bucket 5 (batch 16-31)
    window = [(b, 0.01 * b ** 0.5) for b in (16, 20, 24, 28, 31)]
    samples = {(1, 5): window, (3, 5): [(b, 2 * s) for b, s in window], (1, 4): window}
    assert theil_sen_exponent(samples, 5, 1.2, 8, 1.5) == pytest.approx(0.5)
    # pairs closer than the batch ratio count for nothing: too few pairs
    assert theil_sen_exponent(samples, 5, 1.9, 8, 1.5) is None
    # one batch size has no slope; an exponent past the bounds is clipped
    assert theil_sen_exponent({(1, 5): [(16, 1.0)] * 4}, 5, 1.2, 1, 1.5) is None
    steep = {(1, 5): [(b, 1e-4 * b ** 3) for b in (16, 20, 24, 28, 31)]}
    assert theil_sen_exponent(steep, 5, 1.2, 2, 1.5) == 1.5
    assert math.isclose(theil_sen_exponent({(1, 5): [(16, 2.0), (24, 1.0)]}, 5, 1.2, 1, 1.5), 0.0)
