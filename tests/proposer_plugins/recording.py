"""A proposer that exists only in the test suite, registered through the same
entry-point group as the built-ins. It proposes like the n-gram proposer and
writes every lifecycle call to a JSON-lines file, so that tests can see from
outside the worker what the engine told it."""
from __future__ import annotations

import json
from dataclasses import dataclass

from vllm_specplug.proposers.base import StopReason
from vllm_specplug.proposers.ngram import NgramOptions, NgramProposer

ENTRY_POINT = "test_recording = tests.proposer_plugins.recording:RecordingProposer"


@dataclass(frozen=True)
class RecordingOptions(NgramOptions):
    log_path: str = ""


class RecordingProposer(NgramProposer):
    options_cls = RecordingOptions

    def _log(self, **event) -> None:
        with open(self.options.log_path, "a") as handle:
            handle.write(json.dumps(event) + "\n")

    def start_request(self, req_id, prompt_token_ids) -> None:
        self._log(event="start", req_id=req_id, prompt=[int(t) for t in prompt_token_ids])

    def update_request(self, req_id, new_token_ids) -> None:
        self._log(event="update", req_id=req_id, tokens=[int(t) for t in new_token_ids])

    def stop_request(self, req_id, reason: StopReason) -> None:
        self._log(event="stop", req_id=req_id, reason=reason.value)

    def propose(self, batch):
        drafts = super().propose(batch)
        self._log(event="propose", req_ids=batch.req_ids, k=batch.num_spec_tokens,
                  lengths=[len(d) for d in drafts])
        return drafts
