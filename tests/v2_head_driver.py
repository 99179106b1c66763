"""`SpecplugV2HeadSpeculator` driven on CPU as Model Runner V2 drives it, over
a target's known greedy continuations (what `benchmarks/offline_head_acceptance.py`
computes): a step of prefills, then decode steps whose drafts are verified
greedily against the continuation, with the fields of V2's input batch and
request states the speculator reads (`vllm/v1/worker/gpu/input_batch.py`,
`states.py`: same names, shapes and dtypes). It measures the speculator's
acceptance through its own step path (new requests, prefill ingest, the
fused decode step's verified rows and pass), so that a loss against the
offline drafting of the same head shows on CPU."""
from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch


def _config(head_dir: str, spec: dict, max_num_seqs: int, max_model_len: int, dtype,
            vocab_size: int):
    from vllm_specplug.integration.config import attach, translate

    _, selection = translate({"method": "specplug_eagle3", "model": head_dir, **spec})
    num_steps = spec.get("num_steps", 5)
    spec_config = SimpleNamespace(num_speculative_tokens=num_steps, method="specplug_eagle3")
    attach(spec_config, selection)
    return SimpleNamespace(
        speculative_config=spec_config, device_config=SimpleNamespace(device="cpu"),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, async_scheduling=True,
                                         scheduler_cls=None, get_scheduler_cls=lambda: object),
        model_config=SimpleNamespace(max_model_len=max_model_len, dtype=dtype,
                                     enforce_eager=True, model="target",
                                     get_vocab_size=lambda: vocab_size),
        cache_config=SimpleNamespace(enable_prefix_caching=False, block_size=16),
        structured_outputs_config=SimpleNamespace(reasoning_parser=None,
                                                  reasoning_parser_plugin=None),
        use_v2_model_runner=True)


class RequestStates:
    """The fields of V2's `RequestState` the head speculator reads."""

    def __init__(self, max_num_reqs: int, max_len: int) -> None:
        self.total_len = SimpleNamespace(gpu=torch.zeros(max_num_reqs, dtype=torch.int32))
        self.all_token_ids = SimpleNamespace(gpu=torch.zeros(max_num_reqs, max_len,
                                                             dtype=torch.int32))
        self.prompt_len = SimpleNamespace(np=np.zeros(max_num_reqs, dtype=np.int32))
        self.num_computed_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.req_id_to_index: dict[str, int] = {}


class HeadEngine:
    """Requests of known greedy continuations (token ids [T] each, the
    target's auxiliary hidden states [T, L * H] there, and the prompt's
    length), decoded by the head speculator on CPU. `accepted` sums the
    drafts accepted at each position; `num_steps` counts verified steps."""

    def __init__(self, head_dir: str, embed, vocab_size: int, continuations, spec: dict,
                 dtype=torch.float32) -> None:
        from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
        from vllm_specplug.proposers.eagle3_head import HeadRuntime

        self.seqs = continuations
        self.num_drafts = spec.get("num_steps", 5)
        max_len = max(len(c.token_ids) for c in continuations) + self.num_drafts + 2
        num_reqs = len(continuations)
        self.states = RequestStates(num_reqs, max_len)
        config = _config(head_dir, spec, num_reqs, max_len, dtype, vocab_size)
        self.speculator = SpecplugV2HeadSpeculator(config, torch.device("cpu"), self.states)
        target = SimpleNamespace(embed_input_ids=embed)
        # one rank, no distributed state: the target's embedding as it is
        with mock.patch("vllm_specplug.integration.head_drafter.token_embedding",
                        lambda model: model.embed_input_ids):
            self.speculator.attach(target, SimpleNamespace(), {})
        self.batch_rows: list[int] = []  # the last step's requests, in batch order
        # the same head as a plain runtime, fed each request's verified
        # positions one step at a time: the drafts the speculator should make
        self.reference = HeadRuntime(self.speculator.runtime.layer, embed)
        self.reference_drafts: dict[int, torch.Tensor] = {}
        self.reference_accepted = np.zeros(self.num_drafts, dtype=np.int64)
        self.num_differing = 0  # steps whose drafts differ from the reference's
        self.last_sampled = torch.zeros(num_reqs, 1, dtype=torch.int64)
        self.accepted = np.zeros(self.num_drafts, dtype=np.int64)
        self.num_steps = 0

    def run(self) -> None:
        drafts = self._prefill()
        live = list(range(len(self.seqs)))
        while True:
            live = [r for r in live if int(self.states.total_len.gpu[r]) + self.num_drafts
                    < len(self.seqs[r].token_ids)]
            if not live:
                return
            drafts = self._decode(live, drafts)

    def _propose(self, batch, aux: list[torch.Tensor], num_sampled, num_rejected,
                 next_prefill) -> torch.Tensor:
        drafts = self.speculator.propose(
            batch, None, None, aux[0], aux, num_sampled, num_rejected, self.last_sampled,
            next_prefill, None, None)
        self.batch_rows = [int(r) for r in batch.idx_mapping_np]
        return drafts.clone()

    def _batch(self, rows: list[int], counts: list[int], input_ids: list[int],
               seq_lens: list[int], prefilling: bool, logits: list[int]):
        """The V2 input batch fields the head speculator reads."""
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        prompt = np.array([self.seqs[r].prompt_len for r in rows], dtype=np.int32)
        return SimpleNamespace(
            num_reqs=len(rows), req_ids=[f"r{r}" for r in rows],
            idx_mapping=torch.tensor(rows, dtype=torch.int32),
            idx_mapping_np=np.asarray(rows, dtype=np.int32),
            query_start_loc=torch.from_numpy(cu), query_start_loc_np=cu,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            seq_lens_cpu_upper_bound=np.asarray(seq_lens, dtype=np.int32),
            num_scheduled_tokens=np.asarray(counts, dtype=np.int32),
            cu_num_logits=torch.from_numpy(np.concatenate([[0], np.cumsum(logits)])
                                           .astype(np.int32)),
            input_ids=torch.tensor(input_ids, dtype=torch.int32),
            is_prefilling_np=np.full(len(rows), prefilling),
            num_computed_prefill_tokens_np=np.zeros(len(rows), dtype=np.int32)
            if prefilling else prompt, prefill_len_np=prompt,
            num_draft_tokens=0 if prefilling else len(rows) * self.num_drafts,
            has_structured_output_reqs=False, num_tokens=int(cu[-1]))

    def _prefill(self) -> torch.Tensor:
        """Every prompt in one step; each request samples its first token."""
        rows = list(range(len(self.seqs)))
        counts = [c.prompt_len for c in self.seqs]
        input_ids = [int(t) for c in self.seqs for t in c.token_ids[:c.prompt_len]]
        aux = torch.cat([c.aux_hidden[:c.prompt_len] for c in self.seqs])
        for r, c in enumerate(self.seqs):
            self._post_update(r, c.token_ids[:c.prompt_len + 1].tolist())
        batch = self._batch(rows, counts, input_ids, [c.prompt_len for c in self.seqs],
                            True, [1] * len(rows))
        ones = torch.ones(len(rows), dtype=torch.int32)
        for r, c in enumerate(self.seqs):
            self._reference_step(r, 0, c.prompt_len)
        return self._propose(batch, self._aux(aux), ones, torch.zeros_like(ones),
                             torch.zeros(1, len(rows), dtype=torch.int64))

    def _reference_step(self, r: int, first: int, end: int) -> None:
        """The reference runtime ingests request r's verified positions
        [first, end) (the target's hidden state at each, the token after it)
        and drafts from the root at `end`."""
        seq, dtype = self.seqs[r], self.reference.layer.dtype
        self.reference.ingest(f"r{r}", seq.aux_hidden[first:end].to(dtype),
                              seq.token_ids[first + 1:end + 1], torch.arange(first, end))
        tree = self.reference.draft_trees([f"r{r}"], seq.token_ids[end:end + 1],
                                          torch.tensor([end]), 1, self.num_drafts,
                                          self.num_drafts + 1)
        self.reference_drafts[r] = tree.token_ids[0, 1:].clone()

    def _decode(self, rows: list[int], drafts: torch.Tensor) -> torch.Tensor:
        """One step: each request's root and drafts verified greedily."""
        k = self.num_drafts
        input_ids, aux, seq_lens, num_sampled = [], [], [], []
        row_of = {r: i for i, r in enumerate(self.batch_rows)}
        for r in rows:
            seq, s = self.seqs[r], int(self.states.total_len.gpu[r]) - 1
            proposed = drafts[row_of[r], :k]
            truth = seq.token_ids[s + 1:s + 1 + k]
            hits = (proposed == truth).long().cumprod(0)
            self.accepted += hits.numpy()
            reference = self.reference_drafts[r]
            self.reference_accepted += (reference == truth).long().cumprod(0).numpy()
            self.num_differing += int(not torch.equal(proposed, reference))
            num = int(hits.sum())
            self._reference_step(r, s, s + num + 1)
            input_ids += [int(seq.token_ids[s]), *proposed.tolist()]
            aux.append(seq.aux_hidden[s:s + k + 1])
            seq_lens.append(s + k + 1)
            num_sampled.append(num + 1)
            self._post_update(r, seq.token_ids[:s + num + 2].tolist())
        self.num_steps += len(rows)
        batch = self._batch(rows, [k + 1] * len(rows), input_ids, seq_lens, False,
                            [k + 1] * len(rows))
        sampled = torch.tensor(num_sampled, dtype=torch.int32)
        return self._propose(batch, self._aux(torch.cat(aux)), sampled, k + 1 - sampled,
                             torch.zeros(1, len(self.seqs), dtype=torch.int64))

    def _aux(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """The target's auxiliary layers as V2 hands them over: one [T, H] each."""
        width = rows.shape[1] // 3
        return [rows[:, i * width:(i + 1) * width].contiguous() for i in range(3)]

    def _post_update(self, r: int, tokens: list[int]) -> None:
        """What V2's post_update leaves: the request's tokens so far, the last
        one its last sampled token."""
        self.states.req_id_to_index[f"r{r}"] = r
        self.states.all_token_ids.gpu[r, :len(tokens)] = torch.tensor(tokens)
        self.states.total_len.gpu[r] = len(tokens)
        self.states.num_computed_tokens_np[r] = len(tokens) - 1
        self.last_sampled[r] = tokens[-1]
