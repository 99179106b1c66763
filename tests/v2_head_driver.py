"""`SpecplugV2HeadSpeculator` driven on CPU as Model Runner V2 drives it, over
a target's known greedy continuations (`benchmarks/offline_head_acceptance.py`
computes them): steps of prefills, then decode steps whose drafts are
verified greedily against the continuation, with the fields of V2's input
batch, request states and scheduler output the speculator reads
(`vllm/v1/worker/gpu/input_batch.py`, `states.py`, `vllm/v1/core/sched/output.py`:
same names, shapes and dtypes). A plain `HeadRuntime` of the same head,
fed each request's verified positions from the start of its sequence, drafts
beside it at every step: the drafts the speculator should make. With prefix
caching, a request may start on the blocks an earlier one of the same
sequence left (a chat's next turn): the speculator adopts the head's saved
rows there, the reference ingests the whole prompt."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

from vllm_specplug.proposers.lookup import lookup_chains
from tests.test_lookup_unit import graft_reference
from vllm_specplug.verification.metadata import NO_NODE

BLOCK_SIZE = 16
STALE_TOKEN = 7  # an unfinished prefill's last sample: any read of it shows in its drafts


def _config(head_dir: str, spec: dict, max_num_seqs: int, max_model_len: int, dtype,
            vocab_size: int, hidden_size: int, prefix_caching: bool, device: str):
    from vllm_specplug.integration.config import attach, translate

    _, selection = translate({"method": "specplug_eagle3", "model": head_dir, **spec})
    spec_config = SimpleNamespace(num_speculative_tokens=_num_nodes(spec) - 1,
                                  method="specplug_eagle3")
    attach(spec_config, selection)
    return SimpleNamespace(
        speculative_config=spec_config, device_config=SimpleNamespace(device=device),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, async_scheduling=True,
                                         scheduler_cls=None, get_scheduler_cls=lambda: object),
        # on CUDA the head's passes are graphs, with draft_compile, as in an engine
        model_config=SimpleNamespace(max_model_len=max_model_len, dtype=dtype,
                                     enforce_eager=device == "cpu", model="target",
                                     get_vocab_size=lambda: vocab_size,
                                     get_hidden_size=lambda: hidden_size),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching,
                                     block_size=BLOCK_SIZE),
        structured_outputs_config=SimpleNamespace(reasoning_parser=None,
                                                  reasoning_parser_plugin=None),
        use_v2_model_runner=True)


def _num_nodes(spec: dict) -> int:
    """A spec's drafts a step, the root included (a chain: 1 + num_steps)."""
    return spec.get("num_draft_tokens", 1 + spec.get("num_steps", 5))


class RequestStates:
    """The fields of V2's `RequestState` the head speculator reads."""

    def __init__(self, max_num_reqs: int, max_len: int, device: str = "cpu") -> None:
        self.total_len = SimpleNamespace(gpu=torch.zeros(max_num_reqs, dtype=torch.int32,
                                                         device=device))
        self.all_token_ids = SimpleNamespace(gpu=torch.zeros(max_num_reqs, max_len,
                                                             dtype=torch.int32, device=device))
        self.prompt_len = SimpleNamespace(np=np.zeros(max_num_reqs, dtype=np.int32))
        self.num_computed_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.req_id_to_index: dict[str, int] = {}


@dataclass
class Turn:
    """A request over the sequence of its state slot: its first `prompt_len`
    tokens are the prompt, the first `hit` of them (whole blocks) cached by
    an earlier request of the slot (or by the request of slot `blocks_from`,
    of the same sequence, running beside it), and it decodes while its
    drafts fit before `stop_len`."""
    slot: int
    req_id: str
    prompt_len: int
    stop_len: int
    hit: int = 0
    blocks_from: int | None = None


class HeadEngine:
    """Slot r decodes `continuations[r]` (token ids [T], the target's
    auxiliary hidden states [T, L * H] there) on `device`. `accepted[d]`
    counts the verified steps that accepted a draft at depth d + 1, of
    `num_steps`; `reference_accepted` the reference's, `num_differing` the
    steps whose drafts (tokens or parents) differ from the reference's."""

    def __init__(self, head_dir: str, embed, vocab_size: int, continuations, spec: dict,
                 dtype=torch.float32, prefix_caching: bool = False,
                 device: str = "cpu") -> None:
        from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
        from vllm_specplug.proposers.eagle3_head import HeadRuntime

        self.seqs = continuations
        self.shape = (spec.get("topk", 1), spec.get("num_steps", 5), _num_nodes(spec))
        self.num_drafts = self.shape[2] - 1  # a step's draft tokens (a tree's nodes)
        # the deepest draft: a prompt lookup's branch may reach below the tree
        self.depth = max(self.shape[1], spec.get("prompt_lookup_tokens", 0))
        max_len = max(len(c.token_ids) for c in continuations) + self.num_drafts + 2
        num_slots = len(continuations)
        self.device = device
        self.states = RequestStates(num_slots, max_len, device)
        self.dtype = dtype  # the target's: what V2 hands the head of its hidden states
        hidden_size = continuations[0].aux_hidden.shape[1] // 3
        config = _config(head_dir, spec, num_slots, max_len, dtype, vocab_size, hidden_size,
                         prefix_caching, device)
        self.speculator = SpecplugV2HeadSpeculator(config, torch.device(device), self.states)
        target = SimpleNamespace(embed_input_ids=embed)
        # one rank, no distributed state: the target's embedding as it is
        with mock.patch("vllm_specplug.integration.head_drafter.token_embedding",
                        lambda model: model.embed_input_ids):
            self.speculator.attach(target, SimpleNamespace(bind=lambda *slots: None), {})
        # as V2 does before serving: on CUDA the fused step's graphs and the
        # passes of steps with prefills captured on placeholder inputs
        # (nothing on CPU, where the head runs eagerly)
        self.speculator.capture()
        self.last_sampled = torch.zeros(num_slots, 1, dtype=torch.int64, device=device)
        self.accepted = np.zeros(self.depth, dtype=np.int64)  # steps accepting depth d + 1
        self.num_steps = 0
        self.batch_rows: list[int] = []  # the last step's slots, in batch order
        self.blocks: dict[int, list[int]] = {}  # each slot's request's KV block ids
        self.next_block = 0
        self.finished: list[str] = []  # reported by the next step's scheduler output
        # eager, on the PyTorch attention: on CUDA what the speculator's graphs,
        # kernels and compiled steps should draft
        self.reference = HeadRuntime(self.speculator.runtime.layer, embed,
                                     self.speculator.runtime.draft_temperature,
                                     attention_backend="torch")
        self.reference_drafts: dict[int, tuple[torch.Tensor, list[int]]] = {}  # tokens, parents
        self.reference_accepted = np.zeros(self.depth, dtype=np.int64)
        self.num_differing = 0  # steps whose drafts differ from the reference's
        self.num_looked_up = 0  # reference steps a prompt lookup drafted (chain or branch)
        self.noise = torch.Generator().manual_seed(0)  # rejected rows' hidden states

    def serve(self, turns: list[Turn], after_prefill=None, chunk: int | None = None) -> None:
        """The turns' prefills in one step (`chunk`: their first `chunk`
        uncached positions in a step of their own before it, as vLLM's
        chunked prefill splits a prompt over the token budget), their decode
        steps, their finish; `after_prefill()` runs between the prefill and
        the first decode step."""
        if chunk:
            self._prefill_chunk(turns, chunk)
        drafts = self._prefill(turns, chunk or 0)
        if after_prefill is not None:
            after_prefill()
        self._decode_all(list(turns), drafts)

    def serve_beside(self, running: list[Turn], new: list[Turn]) -> None:
        """`running`'s prefills in one step, then a mixed step: `new`'s
        prefills beside `running`'s first decodes; then all decode."""
        drafts = self._mixed(running, new, self._prefill(running))
        self._decode_all(running + new, drafts)

    def _decode_all(self, turns: list[Turn], drafts: torch.Tensor) -> None:
        """Decode steps while any turn's drafts fit; then they finish."""
        live = list(turns)
        while True:
            live = [t for t in live if int(self.states.total_len.gpu[t.slot]) + self.depth
                    < t.stop_len]
            if not live:
                break
            drafts = self._decode(live, drafts)
        self.finished += [t.req_id for t in turns]

    def _schedule(self, new: list[Turn], running: list[Turn]) -> None:
        """The step's scheduler output, as the speculator's `schedule` sees it
        before the runner applies it: finished requests (then gone from the
        states), new ones with their blocks, running ones' new blocks."""
        new_reqs = []
        for turn in new:
            source = turn.slot if turn.blocks_from is None else turn.blocks_from
            self.blocks[turn.slot] = self.blocks.get(source, [])[:turn.hit // BLOCK_SIZE]
            self._grow(turn)
            new_reqs.append(SimpleNamespace(req_id=turn.req_id, num_computed_tokens=turn.hit,
                                            block_ids=(list(self.blocks[turn.slot]),),
                                            sampling_params=SimpleNamespace(
                                                structured_outputs=None)))
        grown = [self._grow(turn) for turn in running]
        output = SimpleNamespace(
            finished_req_ids=set(self.finished), preempted_req_ids=None,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=SimpleNamespace(req_ids=[t.req_id for t in running],
                                                  new_block_ids=[(g,) if g else None
                                                                 for g in grown]))
        self.speculator.schedule(output, self.states)
        for req_id in self.finished:
            self.states.req_id_to_index.pop(req_id, None)
        self.finished = []

    def _grow(self, turn: Turn) -> list[int]:
        """Fresh block ids for the turn's positions this step may write."""
        blocks = self.blocks.setdefault(turn.slot, [])
        end = max(turn.prompt_len, int(self.states.total_len.gpu[turn.slot])) + self.num_drafts
        fresh = list(range(self.next_block, self.next_block + max(
            0, -(-end // BLOCK_SIZE) - len(blocks))))
        self.next_block += len(fresh)
        blocks += fresh
        return fresh

    def _propose(self, batch, aux: torch.Tensor, num_sampled, num_rejected,
                 next_prefill: torch.Tensor | None = None) -> torch.Tensor:
        width = aux.shape[1] // 3  # V2 hands the auxiliary layers over one [T, H] each
        layers = [aux[:, i * width:(i + 1) * width].to(self.device, self.dtype)
                  for i in range(3)]
        drafts = self.speculator.propose(
            batch, None, None, layers[0], layers, num_sampled.to(self.device),
            num_rejected.to(self.device), self.last_sampled,
            torch.zeros(1, len(self.seqs), dtype=torch.int64, device=self.device)
            if next_prefill is None else next_prefill, None, None)
        self.batch_rows = [int(r) for r in batch.idx_mapping_np]
        return drafts.clone()

    def _batch(self, turns: list[Turn], counts: list[int], input_ids: list[int],
               seq_lens: list[int], prefilling: bool | list[bool],
               firsts: list[int] | None = None):
        """The V2 input batch fields the head speculator reads (`prefilling`:
        every request's or each one's; `firsts`: a prefill's first position
        of the step, each turn's hit by default)."""
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        slots = [t.slot for t in turns]
        prompt = np.array([t.prompt_len for t in turns], dtype=np.int32)
        if firsts is None:
            firsts = [t.hit for t in turns]
        prefilling = np.broadcast_to(np.asarray(prefilling, dtype=bool), (len(turns),))
        first = np.where(prefilling, np.asarray(firsts, dtype=np.int32), prompt)
        return SimpleNamespace(
            num_reqs=len(turns), req_ids=[t.req_id for t in turns],
            idx_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),  # as V2's
            idx_mapping_np=np.asarray(slots, dtype=np.intp),
            query_start_loc=torch.from_numpy(cu).to(self.device), query_start_loc_np=cu,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            seq_lens_cpu_upper_bound=np.asarray(seq_lens, dtype=np.int32),
            num_scheduled_tokens=np.asarray(counts, dtype=np.int32),
            # a prefill's logits: its last row's; a decode's: every draft's and the bonus
            cu_num_logits=torch.from_numpy(np.concatenate(
                [[0], np.cumsum([1 if p else c for p, c in zip(prefilling, counts)])])
                .astype(np.int32))
            .to(self.device),
            input_ids=torch.tensor(input_ids, dtype=torch.int32, device=self.device),
            is_prefilling_np=prefilling.copy(),
            num_computed_prefill_tokens_np=first, prefill_len_np=prompt,
            num_draft_tokens=int((~prefilling).sum()) * self.num_drafts,
            has_structured_output_reqs=False, num_tokens=int(cu[-1]))

    def _prefill_chunk(self, turns: list[Turn], chunk: int) -> None:
        """A prompt's first chunk: positions [hit, hit + chunk) of each turn,
        new to its slot; no token is sampled (V2 hands the speculator the
        next prompt token as each one's next, and a stale last sample, which
        must not be read), the drafts are dropped, as the scheduler does."""
        self._schedule(turns, [])
        for t in turns:
            assert t.hit + chunk < t.prompt_len, "a chunk must leave the prompt unfinished"
            self.states.req_id_to_index[t.req_id] = t.slot
            self.states.prompt_len.np[t.slot] = t.prompt_len
            tokens = self.seqs[t.slot].token_ids[:t.prompt_len]
            self.states.all_token_ids.gpu[t.slot, :t.prompt_len] = tokens.to(self.device)
            self.states.total_len.gpu[t.slot] = t.prompt_len
            self.states.num_computed_tokens_np[t.slot] = t.hit
            self.last_sampled[t.slot] = STALE_TOKEN
            self.reference.forget(t.req_id)
        ends = [t.hit + chunk for t in turns]
        next_prefill = torch.zeros(1, len(self.seqs), dtype=torch.int64, device=self.device)
        for t, end in zip(turns, ends):
            next_prefill[0, t.slot] = int(self.seqs[t.slot].token_ids[end])
        self._prefill_part(turns, [t.hit for t in turns], ends, next_prefill)

    def _prefill(self, turns: list[Turn], chunked: int = 0) -> torch.Tensor:
        """The turns' uncached prompt positions (after a first chunk of
        `chunked` positions, if any) in one step; each samples its first
        token."""
        if not chunked:
            self._schedule(turns, [])
        else:
            self._schedule([], turns)
        for t in turns:
            self._start(t, forget=not chunked)
        return self._prefill_part(turns, [t.hit + chunked for t in turns],
                                  [t.prompt_len for t in turns])

    def _start(self, t: Turn, forget: bool = True) -> None:
        """The states of a request whose prompt ends this step, its first
        token sampled; the reference ingests the whole prompt."""
        self.states.req_id_to_index[t.req_id] = t.slot
        self.states.prompt_len.np[t.slot] = t.prompt_len
        self._post_update(t.slot, self.seqs[t.slot].token_ids[:t.prompt_len + 1].tolist())
        if forget:
            self.reference.forget(t.req_id)
        self._reference_step(t, 0, t.prompt_len)

    def _prefill_part(self, turns: list[Turn], firsts: list[int], ends: list[int],
                      next_prefill: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill positions [firsts[i], ends[i]) of each turn, one step."""
        counts = [end - first for first, end in zip(firsts, ends)]
        input_ids, aux = self._prefill_rows(turns, firsts, ends)
        batch = self._batch(turns, counts, input_ids, ends, True, firsts)
        ones = torch.ones(len(turns), dtype=torch.int32)
        return self._propose(batch, torch.cat(aux), ones, torch.zeros_like(ones), next_prefill)

    def _prefill_rows(self, turns: list[Turn], firsts: list[int], ends: list[int]):
        """Input ids and the target's hidden states (one tensor a turn) of
        prompt positions [firsts[i], ends[i])."""
        input_ids = [int(x) for t, first, end in zip(turns, firsts, ends)
                     for x in self.seqs[t.slot].token_ids[first:end]]
        return input_ids, [self.seqs[t.slot].aux_hidden[first:end]
                           for t, first, end in zip(turns, firsts, ends)]

    def _decode(self, turns: list[Turn], drafts: torch.Tensor) -> torch.Tensor:
        """One step: each request's root and drafts (a chain, or a tree's
        nodes parents first) verified greedily; for trees the accepted path
        goes where the tree sampler writes it (`TreeSlots.accepted_nodes`)."""
        self._schedule([], turns)
        input_ids, aux, seq_lens, num_sampled = self._decode_rows(turns, drafts)
        batch = self._batch(turns, [self.num_drafts + 1] * len(turns), input_ids, seq_lens,
                            False)
        sampled = torch.tensor(num_sampled, dtype=torch.int32)
        return self._propose(batch, torch.cat(aux), sampled,
                             self.num_drafts + 1 - sampled)

    def _decode_rows(self, turns: list[Turn], drafts: torch.Tensor):
        """The decode rows of a step's first requests `turns` (input ids, the
        target's hidden states there, sequence lengths, tokens sampled), their
        drafts verified and the states advanced."""
        row_of = {r: i for i, r in enumerate(self.batch_rows)}
        input_ids, aux, seq_lens, num_sampled = [], [], [], []
        for b, t in enumerate(turns):
            seq, s = self.seqs[t.slot], int(self.states.total_len.gpu[t.slot]) - 1
            proposed = drafts[row_of[t.slot], :self.num_drafts]
            parents, path = self._verify(t, s, proposed)
            self.accepted[:len(path) - 1] += 1
            self._compare(t, s, proposed, parents)
            if self.speculator.tree_slots is not None:
                self.speculator.tree_slots.accepted_nodes[b] = NO_NODE
                self.speculator.tree_slots.accepted_nodes[b, :len(path)] = torch.tensor(
                    path, device=self.device)
            depths = self._depths(parents)
            input_ids += [int(seq.token_ids[s]), *proposed.tolist()]
            aux.append(self._step_states(seq, s, depths, path))
            seq_lens.append(s + self.num_drafts + 1)
            num_sampled.append(len(path))
            self._post_update(t.slot, seq.token_ids[:s + len(path) + 1].tolist())
            self._reference_step(t, s, s + len(path))
        self.num_steps += len(turns)
        return input_ids, aux, seq_lens, num_sampled

    def _mixed(self, decodes: list[Turn], prefills: list[Turn], drafts: torch.Tensor):
        """A mixed step: `decodes` verify their drafts (first in the batch, as
        V2 orders running requests) beside `prefills`' whole prompts."""
        self._schedule(prefills, decodes)
        input_ids, aux, seq_lens, num_sampled = self._decode_rows(decodes, drafts)
        for t in prefills:
            self._start(t)
        ids, rows = self._prefill_rows(prefills, [t.hit for t in prefills],
                                       [t.prompt_len for t in prefills])
        input_ids, aux = input_ids + ids, aux + rows
        seq_lens += [t.prompt_len for t in prefills]
        counts = ([self.num_drafts + 1] * len(decodes)
                  + [t.prompt_len - t.hit for t in prefills])
        batch = self._batch(decodes + prefills, counts, input_ids, seq_lens,
                            [False] * len(decodes) + [True] * len(prefills),
                            [0] * len(decodes) + [t.hit for t in prefills])
        sampled = torch.tensor(num_sampled + [1] * len(prefills), dtype=torch.int32)
        rejected = torch.tensor([self.num_drafts + 1 - n for n in num_sampled]
                                + [0] * len(prefills), dtype=torch.int32)
        return self._propose(batch, torch.cat(aux), sampled, rejected)

    def _step_states(self, seq, root: int, depths: torch.Tensor, path: list[int]):
        """The target's hidden states at a step's rows [N + 1, L * H]: the
        accepted path's are the continuation's; a rejected node's are noise,
        as the target's there (computed on a token off the continuation) are
        nothing the head may use: a speculator reading one would draft
        otherwise than the reference."""
        rows = seq.aux_hidden[root + depths].clone()
        rejected = [n for n in range(len(depths)) if n not in path]
        if rejected:
            noise = torch.randn(len(rejected), rows.shape[1], generator=self.noise)
            rows[rejected] = noise * rows.std()
        return rows

    def _verify(self, turn: Turn, root: int, proposed: torch.Tensor):
        """The drafts' parents ([N] node ids, -1 for the root: a chain's
        unless the speculator keeps trees) and their accepted path."""
        tree_slots = self.speculator.tree_slots
        parents = (tree_slots.parents[turn.slot, :self.num_drafts + 1].tolist()
                   if tree_slots is not None else list(range(-1, self.num_drafts)))
        return parents, self._path(turn, root, proposed.tolist(), parents)

    def _path(self, turn: Turn, root: int, tokens: list[int], parents: list[int]) -> list[int]:
        """Greedy verification: from the root (node 0), each step takes the
        child whose token is the continuation's next; the path's nodes."""
        truth, nodes, path = self.seqs[turn.slot].token_ids, [None, *tokens], [0]
        while len(path) <= self.depth:
            want = int(truth[root + len(path)])
            child = next((n for n in range(1, len(nodes))
                          if parents[n] == path[-1] and nodes[n] == want), None)
            if child is None:
                break
            path.append(child)
        return path

    @staticmethod
    def _depths(parents: list[int]) -> torch.Tensor:
        depths = [0]
        for node in range(1, len(parents)):
            depths.append(depths[parents[node]] + 1)
        return torch.tensor(depths)

    def _compare(self, turn: Turn, root: int, proposed: torch.Tensor, parents: list[int]):
        """The reference's drafts for this step, verified the same way."""
        tokens, ref_parents = self.reference_drafts[turn.slot]
        path = self._path(turn, root, tokens.tolist(), ref_parents)
        self.reference_accepted[:len(path) - 1] += 1
        self.num_differing += int(not torch.equal(proposed, tokens)
                                  or parents != ref_parents)

    def _reference_step(self, turn: Turn, first: int, end: int) -> None:
        """The reference ingests the turn's verified positions [first, end)
        (the target's hidden state at each, the token after it) and drafts
        from the root at `end`. (An adopted prefix keeps its last row: the
        request that saved it, of the same sequence, had the same token
        after it, `HeadBlockStore.gather_many`.)"""
        seq, dtype = self.seqs[turn.slot], self.reference.layer.dtype
        device = self.device
        self.reference.ingest(turn.req_id, seq.aux_hidden[first:end].to(device, dtype),
                              seq.token_ids[first + 1:end + 1].to(device),
                              torch.arange(first, end, device=device))
        tree = self.reference.draft_trees([turn.req_id], seq.token_ids[end:end + 1].to(device),
                                          torch.tensor([end], device=device), *self.shape)
        tokens, parents = tree.token_ids[0, 1:].clone(), tree.parent_ids[0].tolist()
        lookup = self.speculator.lookup
        if lookup is not None:  # a prompt lookup where the history repeats
            looked_up, lengths = lookup_chains(seq.token_ids[None, :end + 1].cpu().numpy(),
                                               np.array([end + 1]), lookup.drafter.n_min,
                                               lookup.drafter.n_max, lookup.k)
            length = int(lengths[0])  # a chain takes a whole lookup, a tree any
            if length == lookup.k or (length and self.speculator.tree_slots is not None):
                # a chain's drafts, a tree's extra branch (written plainly)
                nodes, parents, _ = graft_reference([-1, *tokens.tolist()], parents,
                                                    looked_up[0, :length].tolist())
                tokens = torch.tensor(nodes[1:]).to(tokens)
                self.num_looked_up += 1
        self.reference_drafts[turn.slot] = (tokens, parents)

    def _post_update(self, slot: int, tokens: list[int]) -> None:
        """What V2's post_update leaves: the request's tokens so far (the last
        one its last sampled token), the positions computed before it."""
        self.states.all_token_ids.gpu[slot, :len(tokens)] = torch.tensor(tokens,
                                                                         device=self.device)
        self.states.total_len.gpu[slot] = len(tokens)
        self.states.num_computed_tokens_np[slot] = len(tokens) - 1
        self.last_sampled[slot] = tokens[-1]
