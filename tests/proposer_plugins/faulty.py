"""A deliberately faulty proposer, registered (in tests only) through the same
entry-point group as the built-ins, to check that a faulty third-party
proposer costs speculation and never the engine.

It proposes like the n-gram proposer; option `fault` picks what goes wrong,
on the calls of the faulty method after the first `after` ones (`times`
faulty calls, 0 = every later call). `log_file` sends the worker's
`vllm_specplug` log records to a file the test can read. `FaultProbe` is a
vLLM worker extension that reports the drafter's guard state from inside
the worker (`llm.collective_rpc("specplug_fault_state")`). `make_drafter` and
`FakeRunner` drive a real `SpecplugDrafter` without an engine.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from vllm_specplug.integration.config import attach, translate
from vllm_specplug.integration.v1.drafter import SpecplugDrafter
from vllm_specplug.integration.guard import DEFAULT_MAX_PROPOSER_FAILURES
from vllm_specplug.proposers.base import require
from vllm_specplug.proposers.ngram import NgramOptions, NgramProposer

ENTRY_POINT = "test_faulty = tests.proposer_plugins.faulty:FaultyProposer"
PROBE_QUALNAME = "tests.proposer_plugins.faulty.FaultProbe"
OUT_OF_VOCAB = 10**6
K, VOCAB = 3, 32  # the fake runner's defaults

LIFECYCLE_FAULTS = {"start_raises": "start_request", "update_raises": "update_request",
                    "stop_raises": "stop_request"}
# fault -> what propose returns instead of the n-gram drafts (k: this step's allowance)
DRAFT_FAULTS = {
    "out_of_vocab": lambda drafts, k: [[OUT_OF_VOCAB] for _ in drafts],
    "negative": lambda drafts, k: [[-1] for _ in drafts],
    "too_many": lambda drafts, k: [[1] * (k + 1) for _ in drafts],
    "strings": lambda drafts, k: [["1", "2"] for _ in drafts],
    "floats": lambda drafts, k: [[1.0, 2.0] for _ in drafts],
    "none": lambda drafts, k: None,
    "wrong_count": lambda drafts, k: drafts[:-1] if len(drafts) > 1 else drafts + [[]],
}
FAULTS = ("", "propose_raises", "write_history", *LIFECYCLE_FAULTS, *DRAFT_FAULTS)


class ProposerFault(RuntimeError):
    pass


@dataclass(frozen=True)
class FaultyOptions(NgramOptions):
    fault: str = ""
    after: int = 0  # healthy calls of the faulty method before the fault
    times: int = 0  # faulty calls from then on; 0: every later call
    log_file: str = ""

    def validate(self, name: str) -> None:
        super().validate(name)
        require(self.fault in FAULTS, name, f"fault={self.fault!r} must be one of {FAULTS}")


class FaultyProposer(NgramProposer):
    options_cls = FaultyOptions

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        self.calls: Counter = Counter()  # per method
        self.faults = 0
        self.fault_req_ids: list[list[str]] = []  # request ids of each faulty call
        if options.log_file:
            handler = logging.FileHandler(options.log_file)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
            logging.getLogger("vllm_specplug").addHandler(handler)

    def _faulty(self, method: str, req_ids: list[str]) -> bool:
        """Count a call of `method`; True when this call must go wrong."""
        self.calls[method] += 1
        faulty_method = LIFECYCLE_FAULTS.get(self.options.fault, "propose")
        if not self.options.fault or method != faulty_method:
            return False
        after, times = self.options.after, self.options.times
        n = self.calls[method]
        if n <= after or (times and n > after + times):
            return False
        self.faults += 1
        self.fault_req_ids.append(list(req_ids))
        return True

    def start_request(self, req_id, prompt_token_ids) -> None:
        if self._faulty("start_request", [req_id]):
            raise ProposerFault(f"start_request fault for {req_id}")

    def update_request(self, req_id, new_token_ids) -> None:
        if self._faulty("update_request", [req_id]):
            raise ProposerFault(f"update_request fault for {req_id}")

    def stop_request(self, req_id, reason) -> None:
        if self._faulty("stop_request", [req_id]):
            raise ProposerFault(f"stop_request fault for {req_id}")

    def propose(self, batch):
        drafts = super().propose(batch)
        if not self._faulty("propose", batch.req_ids):
            return drafts
        fault = self.options.fault
        if fault == "propose_raises":
            raise RuntimeError(f"propose fault on call {self.calls['propose']}")
        if fault == "write_history":
            batch.token_ids[:, 0] = 0  # must fail: the history is read-only
            return drafts
        return DRAFT_FAULTS[fault](drafts, batch.num_spec_tokens)


class FaultProbe:
    """vLLM worker extension: the drafter's guard and proposer, as seen in the worker."""

    def specplug_fault_state(self) -> dict:
        drafter = self.model_runner.drafter
        proposer = drafter.proposer
        return {"failure_counts": dict(drafter.failure_counts),
                "disabled": drafter.guard.disabled,
                "quarantined": sorted(drafter.quarantined),
                "calls": dict(proposer.calls), "faults": proposer.faults,
                "fault_req_ids": proposer.fault_req_ids}


def install_entry_point(site: Path) -> Path:
    """A dist-info declaring `test_faulty` in `site`; put `site` on sys.path."""
    dist = site / "specplug_faulty_plugins-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: specplug-faulty-plugins\n"
                                   "Version: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm_specplug.proposers]\n{ENTRY_POINT}\n")
    return site


def make_drafter(options: dict, max_failures: int = DEFAULT_MAX_PROPOSER_FAILURES,
                 method: str = "test_faulty", max_model_len: int = 256, k: int = K,
                 vocab_size: int = VOCAB) -> SpecplugDrafter:
    """A drafter as vLLM builds it, for `method` with `options` (no engine)."""
    # adaptive off: these tests check the guard on the drafts as proposed
    _, selection = translate({"method": method, "num_speculative_tokens": k,
                              "max_proposer_failures": max_failures, "adaptive": False,
                              **options})
    spec = SimpleNamespace(num_speculative_tokens=k)
    attach(spec, selection)
    return SpecplugDrafter(SimpleNamespace(
        speculative_config=spec, device_config=SimpleNamespace(device="cpu"),
        model_config=SimpleNamespace(max_model_len=max_model_len,
                                     get_vocab_size=lambda: vocab_size)))


class FakeRunner:
    """vLLM's batch state, as the drafter reads it: requests whose outputs
    repeat their prompt's period-4 cycle (so n-gram drafts are never empty)."""

    def __init__(self, num_reqs: int, width: int = 256) -> None:
        self.token_ids = np.zeros((num_reqs, width), dtype=np.int32)
        prompts = [[(r + j) % 4 + 4 * r for j in range(8)] for r in range(num_reqs)]
        for r, prompt in enumerate(prompts):
            self.token_ids[r, :8] = prompt
        self.input_batch = SimpleNamespace(
            req_ids=[f"req-{r}" for r in range(num_reqs)],
            num_prompt_tokens=np.full(num_reqs, 8, dtype=np.int32),
            num_tokens_no_spec=np.full(num_reqs, 8, dtype=np.int32),
            token_ids_cpu=self.token_ids)

    def step(self, drafter: SpecplugDrafter, k: int = K) -> list[list[int]]:
        """Sample one token per request, then ask for drafts; checks the
        drafts are safe for the target whatever the proposer did."""
        batch = self.input_batch
        sampled = []
        for r in range(len(batch.req_ids)):
            n = batch.num_tokens_no_spec[r]
            self.token_ids[r, n] = self.token_ids[r, n - 4]
            batch.num_tokens_no_spec[r] += 1
            sampled.append([int(self.token_ids[r, n])])
        before = self.token_ids.copy()
        drafts = drafter.propose_for_runner(
            self, SimpleNamespace(preempted_req_ids=set(), num_spec_tokens_to_schedule=k,
                                  total_num_scheduled_tokens=len(sampled) * (k + 1)),
            sampled, {"sample_hidden_states": None, "spec_decode_metadata": None})
        assert np.array_equal(before, self.token_ids), "the runner's buffer changed"
        assert len(drafts) == len(batch.req_ids)
        for draft in drafts:
            assert type(draft) is list and len(draft) <= k
            assert all(type(t) is int and 0 <= t < drafter.vocab_size for t in draft)
        return drafts

    def remove(self, drafter: SpecplugDrafter, r: int) -> None:
        drafter.on_request_removed(self.input_batch.req_ids[r])
