"""Stand-ins for the parts of Model Runner V2 our speculator reads (same
field names, shapes and dtypes as `vllm/v1/worker/gpu/states.py` and
`input_batch.py`), and a driver for one step. Used by the adapter's unit
tests on CPU (host path) and under the Triton interpreter (device path)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm_specplug.integration.config import attach, translate
from vllm_specplug.integration.v2.speculator import SpecplugV2Speculator

K = 3
MAX_LEN = 64


class States:
    """The fields of vLLM's `RequestState` the adapter reads."""

    def __init__(self, max_num_reqs: int = 4, device: str = "cpu") -> None:
        self.all_token_ids = SimpleNamespace(gpu=torch.zeros(max_num_reqs, MAX_LEN,
                                                             dtype=torch.int32, device=device))
        self.total_len = SimpleNamespace(gpu=torch.zeros(max_num_reqs, dtype=torch.int32,
                                                         device=device))
        self.prompt_len = SimpleNamespace(np=np.zeros(max_num_reqs, dtype=np.int32))
        self.last_sampled_tokens = torch.zeros(max_num_reqs, 1, dtype=torch.int64,
                                               device=device)
        self.req_id_to_index: dict[str, int] = {}

    def add(self, req_id: str, slot: int, prefill: list[int],
            num_prompt: int | None = None) -> None:
        """A new request, or a preempted one resuming with its outputs."""
        self.req_id_to_index[req_id] = slot
        self.all_token_ids.gpu[slot, :len(prefill)] = torch.tensor(prefill)
        self.total_len.gpu[slot] = len(prefill)
        self.prompt_len.np[slot] = len(prefill) if num_prompt is None else num_prompt
        self.last_sampled_tokens[slot] = prefill[-1]

    def sample(self, req_id: str, tokens: list[int]) -> None:
        """What vLLM's post_update does: append the step's accepted tokens."""
        slot = self.req_id_to_index[req_id]
        n = int(self.total_len.gpu[slot])
        self.all_token_ids.gpu[slot, n:n + len(tokens)] = torch.tensor(tokens)
        self.total_len.gpu[slot] = n + len(tokens)
        self.last_sampled_tokens[slot] = tokens[-1]

    def history(self, req_id: str) -> list[int]:
        slot = self.req_id_to_index[req_id]
        return self.all_token_ids.gpu[slot, :int(self.total_len.gpu[slot])].tolist()


class Spy:
    """Records the lifecycle calls the proposer receives."""

    def __init__(self, proposer) -> None:
        self.calls: list[tuple] = []
        for name in ("start_request", "update_request", "stop_request"):
            original = getattr(proposer, name)
            setattr(proposer, name, self._recording(name, original))

    def _recording(self, name, original):
        def call(req_id, arg):
            value = arg.tolist() if isinstance(arg, np.ndarray) else arg
            self.calls.append((name, req_id, value))
            return original(req_id, arg)
        return call

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


NGRAM = {"method": "specplug_ngram", "num_speculative_tokens": K,
         "prompt_lookup_min": 2, "prompt_lookup_max": 3,
         "adaptive": False}  # drafts as proposed (the adapter alone)


def make_speculator(states: States, use_device_drafter: bool = False,
                    device: str = "cpu", shared=None, spec_config: dict = NGRAM,
                    ) -> SpecplugV2Speculator:
    _, selection = translate(dict(spec_config))
    spec = SimpleNamespace(num_speculative_tokens=K)
    attach(spec, selection)
    config = SimpleNamespace(
        speculative_config=spec, device_config=SimpleNamespace(device=device),
        scheduler_config=SimpleNamespace(max_num_seqs=4, async_scheduling=True,
                                         scheduler_cls=None),
        model_config=SimpleNamespace(max_model_len=MAX_LEN, get_vocab_size=lambda: 1000))
    return SpecplugV2Speculator(config, torch.device(device), states,
                                use_device_drafter=use_device_drafter, shared=shared)


def step(speculator, states: States, req_ids: list[str], num_sampled: list[int]):
    slots = [states.req_id_to_index[r] for r in req_ids]
    device = states.total_len.gpu.device
    batch = SimpleNamespace(num_reqs=len(req_ids), req_ids=req_ids,
                            num_tokens=len(req_ids) * (K + 1),
                            idx_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                            idx_mapping_np=np.asarray(slots, dtype=np.int32))
    drafts = speculator.propose(batch, None, None, None, None,
                                torch.tensor(num_sampled, dtype=torch.int32, device=device),
                                torch.zeros(len(req_ids), dtype=torch.int32, device=device),
                                None, None, None, None)
    return drafts.clone(), speculator.take_drafts(), speculator.take_draft_lengths()
