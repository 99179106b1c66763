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


@pytest.mark.parametrize("extra, focus", [({}, False),
                                          ({"adaptive": "batch", "adaptive_focus": True}, True),
                                          ({"adaptive": True, "adaptive_focus": False}, False)])
def test_adaptive_focus_is_opt_in_beside_the_batch_policy(extra, focus):
    from vllm_specplug.integration.batch_schedule import _focus_wanted
    from vllm_specplug.integration.config import SELECTION_ATTR, translate

    vllm_args, selection = translate({"method": "specplug_suffix",
                                      "num_speculative_tokens": 5, **extra})
    assert "adaptive_focus" not in vllm_args and selection.adaptive_focus is focus
    assert _focus_wanted(SimpleNamespace(**{SELECTION_ATTR: selection})) is focus


@pytest.mark.parametrize("extra, message", [
    ({"adaptive_focus": True}, "set adaptive to true or 'batch' too, or drop it"),
    ({"adaptive": "batch", "adaptive_focus": 1}, "adaptive_focus=1 must be true or false")])
def test_a_bad_adaptive_focus_names_the_field_and_the_fix(extra, message):
    from vllm_specplug.integration.config import translate
    from vllm_specplug.proposers.base import ProposerConfigError

    with pytest.raises(ProposerConfigError, match=message.replace("(", r"\(")):
        translate({"method": "specplug_suffix", "num_speculative_tokens": 5, **extra})
