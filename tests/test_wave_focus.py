"""Whom a draining batch's draft length serves (adaptive/wave_focus.py,
issue 27): each request's acceptance against the batch mean's, and the
request with the most steps left; the scheduler asks only while nothing
waits."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_specplug.adaptive.wave_focus import PRIOR, RequestGains
from vllm_specplug.integration.batch_schedule import BatchDraftSchedule


def test_a_requests_ratio_is_its_accepted_drafts_over_the_means_shrunk_to_one():
    gains = RequestGains()
    assert gains.ratio("new") == 1.0
    gains.observed("good", 4, 2.0)
    gains.observed("none", 0, 2.0)
    assert gains.ratio("good") == pytest.approx((4 + PRIOR) / (2 + PRIOR))
    assert gains.ratio("none") == pytest.approx(PRIOR / (2 + PRIOR))
    for _ in range(50):  # its own drafts outweigh the prior
        gains.observed("none", 0, 2.0)
    assert gains.ratio("none") < 0.1
    gains.forget(["none", "never seen"])
    assert gains.ratio("none") == 1.0 and "good" in gains.sums


def test_the_focus_is_the_request_with_the_most_steps_left():
    """Steps left: tokens left over the request's own expected tokens a
    step; a request that accepts nothing needs a step a token."""
    gains = RequestGains()
    for _ in range(30):
        gains.observed("fast", 3, 1.5)
        gains.observed("slow", 0, 1.5)
    # 40 tokens at 1 a step outlast 90 at about 3.6 a step
    assert gains.focus([("fast", 90), ("slow", 40)], 2.5) == gains.ratio("slow")
    # ... but not 10 tokens
    assert gains.focus([("fast", 90), ("slow", 10)], 2.5) == gains.ratio("fast")
    assert gains.focus([], 2.5) is None
    assert gains.focus([("done", 0)], 2.5) == 1.0  # no tokens left counts as one


def test_the_scheduler_focuses_only_while_nothing_waits():
    gains = RequestGains()
    for _ in range(30):
        gains.observed("a", 0, 1.0)
    running = [SimpleNamespace(request_id="a", max_tokens=48, num_output_tokens=8),
               SimpleNamespace(request_id="b", max_tokens=48, num_output_tokens=40)]
    policy = SimpleNamespace(current=5, expected_tokens=lambda k: 2.0)
    for waiting, expected in ((1, None), (0, gains.ratio("a"))):
        scheduler = SimpleNamespace(gains=gains, running=running, draft_length=policy,
                                    get_request_counts=lambda w=waiting: (2, w))
        assert BatchDraftSchedule._wave_focus(scheduler) == expected
