"""The worker's grammar work a step for constrained trees on Model Runner V2
(issue 30: "report the grammar's own cost per step (CPU) beside the step"),
on CPU, without an engine: our own functions over stand-ins of V2's batch.

A step of B greedy requests under the JSON schema of
benchmarks/json_schema.json, each with a tree of 16 drafts (`topk` 4, 4
levels: a chain of first children and three siblings a level), runs what
the worker runs on the host:

- `rows`: `HeadGrammar.verification_rows` fills every node's row
  (`grammar_verify: "rows"`, the default);
- `choices`: `verification_rows` plans the trees and `GrammarChoices.correct`
  decides each accepted path from the target's argmax (`"choices"`);
- `auto` (`--ways auto`, for its checks more than its times): each step's
  way drawn at random, as `"auto"` switches between them, with a request in
  five left to the scheduler's rows;
- then the drafting pass's first-step masks (`grammar_drafts: "first"`):
  `StructuredRequests.root_bitmask` (the grammars advanced by the step's
  tokens, known on the host under the choices, read from the outputs under
  the rows) and `RootMasks.load`.

Each request's output follows a reference matcher: at every step the target
takes a random path the grammar allows, its tree drafts the first 0-4 of
those tokens on its chain (accepted), and the logits put the target's token
first at each node. Reported: host milliseconds a step for each part
(median over steps; the parts a GPU would run, the choices' argmax and
top-k and the masks' unpacking, apart), and with `--profile` the functions
where they go. Every step checks the worker's grammars against the
reference's and the choices' tokens against the target's path. `--chain K`
runs chains of K drafts instead (our chain's rows, `rows` only).

    .venv/bin/python benchmarks/bench_v2_grammar_step.py --batch 1 16 64 --out docs/results/v2_grammar_step_cpu
    .venv/bin/python benchmarks/bench_v2_grammar_step.py --model DIR --chain 5 --ways rows --batch 16 64
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import MethodType, SimpleNamespace

import numpy as np
import torch
from tqdm import tqdm

SCHEMA_FILE = Path(__file__).with_name("json_schema.json")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_grammar_walk, run or loaded


@dataclass(frozen=True)
class Shape:
    """Each request's drafts a step: `topk` children of the root and of each
    first child, `depth` levels. `topk` 1 is a chain (`--chain K`), whose
    rows the worker fills as our chain's: no parents handed over, and only
    as deep as `RowDepth` says (every row here: the bench accepts each
    depth alike)."""
    topk: int = 4
    depth: int = 4

    @property
    def num_drafts(self) -> int:
        return self.topk * self.depth

    @property
    def chain(self) -> bool:
        return self.topk == 1

    @property
    def parents(self) -> list[int]:
        """Node n's parent: level 1 under the root, each deeper level under
        the level above's first child (the chain)."""
        return [-1] + [0 if n <= self.topk else 1 + self.topk * ((n - 1) // self.topk - 1)
                       for n in range(1, self.num_drafts + 1)]


PROMPT_LEN, MAX_OUTPUT = 16, 4096


def _allowed(grammar, vocab_size: int) -> np.ndarray:
    from vllm_specplug.verification.grammar_greedy import grammar_row

    return np.flatnonzero(grammar_row(grammar, vocab_size)) if not grammar.is_terminated() \
        else np.arange(0)


class Batch:
    """B requests' outputs on the "device" (`req_states`), their reference
    grammars, and each step's trees, drafts and logits."""

    def __init__(self, num_reqs: int, vocab_size: int, new_grammar, rng, shape: Shape):
        self.vocab_size, self.new_grammar, self.rng = vocab_size, new_grammar, rng
        self.shape = shape
        self.req_ids = [f"r{i}" for i in range(num_reqs)]
        self.generation = 0
        self.refs = {req_id: new_grammar() for req_id in self.req_ids}
        self.all_token_ids = torch.zeros(num_reqs, PROMPT_LEN + MAX_OUTPUT, dtype=torch.int64)
        self.total_len = torch.full((num_reqs,), PROMPT_LEN, dtype=torch.int64)
        self.req_states = SimpleNamespace(
            total_len=SimpleNamespace(gpu=self.total_len),
            prompt_len=SimpleNamespace(np=np.full(num_reqs, PROMPT_LEN)),
            all_token_ids=SimpleNamespace(gpu=self.all_token_ids))
        for b, req_id in enumerate(self.req_ids):  # each request's first token
            self.emit(b, [int(self.rng.choice(list(_allowed(self.refs[req_id], vocab_size))))])

    def emit(self, b: int, token_ids: list[int]) -> None:
        end = int(self.total_len[b])
        self.all_token_ids[b, end:end + len(token_ids)] = torch.tensor(token_ids)
        self.total_len[b] = end + len(token_ids)
        self.refs[self.req_ids[b]].accept_tokens("ref", token_ids)

    def replace_finished(self) -> tuple[set[str], list[str]]:
        """Each request whose grammar ended (or output filled up) gives its
        slot to a new one, as continuous batching does: (finished ids, new ids)."""
        finished, new = set(), []
        for b, req_id in enumerate(self.req_ids):
            if not (self.refs[req_id].is_terminated()
                    or self.total_len[b] > MAX_OUTPUT - 2 * self.shape.depth):
                continue
            self.generation += 1
            finished.add(req_id)
            del self.refs[req_id]
            self.req_ids[b] = f"r{b}-{self.generation}"
            self.refs[self.req_ids[b]] = self.new_grammar()
            self.total_len[b] = PROMPT_LEN
            self.emit(b, [int(self.rng.choice(list(_allowed(self.refs[self.req_ids[b]],
                                                              self.vocab_size))))])
            new.append(self.req_ids[b])
        return finished, new

    def tree(self, b: int) -> tuple[list[int], list[int], list[int]]:
        """(drafts [num_drafts], target tokens [num_drafts + 1] per node,
        emitted tokens) of request b this step."""
        ref, (topk, depth, num_drafts) = self.refs[self.req_ids[b]], (
            self.shape.topk, self.shape.depth, self.shape.num_drafts)
        parents = self.shape.parents
        path = []
        for _ in range(depth + 1):
            allowed = _allowed(ref, self.vocab_size)
            if not len(allowed):
                break
            path.append(int(self.rng.choice(list(allowed))))
            ref.accept_tokens("ref", [path[-1]])
        ref.rollback(len(path))
        accepted = min(self.rng.randint(0, depth), len(path) - 1)
        drafts = [int(self.rng.randrange(self.vocab_size)) for _ in range(num_drafts)]
        targets = [int(self.rng.randrange(self.vocab_size)) for _ in range(num_drafts + 1)]
        chain = [0] + [1 + topk * level for level in range(depth)]  # the root, then first children
        for level in range(accepted + 1):
            targets[chain[level]] = path[level]
            if level < accepted:
                drafts[chain[level + 1] - 1] = path[level]
        on_path = set(chain[1:accepted + 1])
        for node in range(1, num_drafts + 1):  # no other node drafts its parent's target token
            if node not in on_path and drafts[node - 1] == targets[parents[node]]:
                drafts[node - 1] = (drafts[node - 1] + 1) % self.vocab_size
        return drafts, targets, path[:accepted + 1]

    def input_batch(self):
        num_reqs, num_drafts = len(self.req_ids), self.shape.num_drafts
        slots = np.arange(num_reqs)
        return SimpleNamespace(
            req_ids=list(self.req_ids), num_reqs=num_reqs, idx_mapping_np=slots,
            idx_mapping=torch.from_numpy(slots), num_draft_tokens=num_drafts * num_reqs,
            num_draft_tokens_per_req=np.full(num_reqs, num_drafts),
            cu_num_logits_np=np.arange(num_reqs + 1) * (num_drafts + 1),
            seq_lens_cpu_upper_bound=self.total_len.numpy() + num_drafts)


def _speculator(vllm_config, batch: Batch, choices: bool):
    """`SpecplugV2HeadSpeculator`'s fields its grammar functions read."""
    from vllm_specplug.integration.guard import ProposerGuard
    from vllm_specplug.integration.row_threads import RowThreads
    from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
    from vllm_specplug.integration.v2.root_masks import RootMasks
    from vllm_specplug.integration.v2.speculator import SpeculatorStats
    from vllm_specplug.integration.v2.structured import StructuredRequests
    from vllm_specplug.integration.worker_rows import RowDepth

    structured = StructuredRequests(vllm_config)
    _schedule(structured, set(), batch.req_ids)
    speculator = SimpleNamespace(
        structured=structured, req_states=batch.req_states,
        tree_slots=None if batch.shape.chain else object(),
        stats=SpeculatorStats("cpu"), worker_rows_req_ids=[], tree_rows=None,
        row_depth=RowDepth(batch.shape.num_drafts) if batch.shape.chain else None,
        row_threads=RowThreads(1),
        grammar_choices=SpecplugV2HeadSpeculator.choices_for(structured) if choices else None,
        choices_min_trees=1 if choices else None, guard=ProposerGuard("bench", 10 ** 9),
        root_masks=RootMasks(len(batch.req_ids), batch.vocab_size,
                             torch.arange(batch.vocab_size)))
    for name in ("verification_rows", "_verification_rows", "_fill_rows", "_plan_choices",
                 "_load_root_masks"):
        setattr(speculator, name, MethodType(getattr(SpecplugV2HeadSpeculator, name), speculator))
    return speculator


def _schedule(structured, finished: set[str], new: list[str]) -> None:
    """The scheduler output's part `StructuredRequests` reads: requests
    under the JSON schema (vLLM's xgrammar backend) in, finished ones out."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_OUTPUT, structured_outputs=(
        StructuredOutputsParams(json=SCHEMA_FILE.read_text())))
    params.structured_outputs._backend = "xgrammar"
    structured.schedule(SimpleNamespace(finished_req_ids=finished, scheduled_new_reqs=[
        SimpleNamespace(req_id=req_id, sampling_params=params) for req_id in new]))


def _runner(batch: Batch, drafts, input_batch):
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    from vllm_specplug.integration.grammar_trees import TREE_PARENTS_ATTR

    taken = DraftTokenIds(list(batch.req_ids), drafts)
    if not batch.shape.chain:  # a chain's parents are never handed over (GrammarParents)
        setattr(taken, TREE_PARENTS_ATTR, {req_id: batch.shape.parents
                                           for req_id in batch.req_ids})
    n, vocab = len(batch.req_ids), batch.vocab_size
    full = lambda value: SimpleNamespace(np=np.full(n, value))  # noqa: E731
    states = SimpleNamespace(temperature=full(0.0), min_p=full(0.0), top_k=full(vocab),
                             top_p=full(1.0), vocab_size=vocab,
                             max_num_logprobs=lambda idx: NO_LOGPROBS)
    sampler = SimpleNamespace(sampling_states=states, needs_logits_processing=np.zeros(n, bool),
                              return_sampling_mask=False, trace_replay_state=None)
    return SimpleNamespace(execute_model_state=SimpleNamespace(input_batch=input_batch),
                           take_draft_token_ids=lambda: taken, sampler=sampler,
                           batch_sharder=None)


class Timed:
    """Host seconds spent in one method of an object, summed until taken."""

    def __init__(self, owner, name: str) -> None:
        self.seconds, method = 0.0, getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        setattr(owner, name, timed)

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


PARTS = ("verification_rows", "walks", "root_bitmask", "node_choices", "root_load")


def run_steps(vllm_config, new_grammar, vocab_size: int, num_reqs: int, way: str,
              num_steps: int, seed: int, profiler=None,
              shape: Shape = Shape()) -> dict[str, list[float]]:
    """Host seconds of each part, step by step, for one way of verifying:
    the host's own work (`verification_rows`, the choices' `walks`, the
    first-step masks' `root_bitmask`) and what is the GPU's there
    (`node_choices`: the argmax and top-k copied to the host; `root_load`:
    the masks unpacked on the device), timed apart on this CPU."""
    batch = Batch(num_reqs, vocab_size, new_grammar, random.Random(seed), shape)
    speculator = _speculator(vllm_config, batch, way != "rows")
    node_choices = (Timed(speculator.grammar_choices, "host_choices") if way != "rows"
                    else None)
    ways = random.Random(seed + 1)  # "auto": each step's way drawn
    root_load = Timed(speculator.root_masks, "load")
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    for _ in range(num_steps):
        finished, new = batch.replace_finished()
        if new:
            _schedule(speculator.structured, finished, new)
        trees = [batch.tree(b) for b in range(num_reqs)]
        input_batch = batch.input_batch()
        runner = _runner(batch, [t[0] for t in trees], input_batch)
        logits = torch.randn(num_reqs * (shape.num_drafts + 1), vocab_size)
        logits[torch.arange(logits.shape[0]),
               torch.tensor([tok for t in trees for tok in t[1]])] = 10.0
        target_tokens = logits.argmax(-1)  # the sampler's draws
        speculator.worker_rows_req_ids = list(batch.req_ids)
        if way == "auto":  # the step's trees under or over `grammar_choices_min_trees`,
            speculator.choices_min_trees = ways.choice([1, num_reqs + 1])
            # and a request in five left to the scheduler's rows (its output then
            # read by the next drafting pass, as a request without drafts is)
            speculator.worker_rows_req_ids = [req_id for req_id in batch.req_ids
                                              if ways.random() >= 0.2]
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        speculator.verification_rows(runner, None)
        times["verification_rows"].append(time.perf_counter() - start)
        emitted = {}
        if way != "rows":  # the tree sampler calls it on every step it has the choices
            start = time.perf_counter()
            speculator.grammar_choices.correct(logits, target_tokens, input_batch)
            copy = node_choices.take()
            times["walks"].append(time.perf_counter() - start - copy)
            times["node_choices"].append(copy)
            emitted = dict(speculator.grammar_choices.emitted)
        for b, tree in enumerate(trees):  # what the device emits
            batch.emit(b, tree[2])
        speculator.structured.begin_step()
        start = time.perf_counter()
        speculator._load_root_masks(input_batch, True)
        load = root_load.take()
        times["root_bitmask"].append(time.perf_counter() - start - load)
        times["root_load"].append(load)
        if profiler is not None:
            profiler.disable()
        _check(speculator, batch, trees, emitted)
    return times


def _check(speculator, batch: Batch, trees, emitted: dict[str, list[int]]) -> None:
    """The worker's grammars are in their outputs' states (their counts and
    their next rows: `same_row_as_output`) and the choices' emitted tokens
    are the target's: a benchmark of wrong work measures nothing."""
    from vllm_specplug.testing.grammar_checks import same_row_as_output

    tracked = speculator.structured.grammars.tracked
    for b, req_id in enumerate(batch.req_ids):
        grammar = tracked[req_id].holder.structured_output_request.grammar
        if grammar is None:  # still compiling: no rows or masks from it yet
            continue
        # as far as the worker advanced it: all of the output, unless it
        # compiled after this step's drafting pass asked (then at the next read)
        num_accepted = tracked[req_id].num_accepted
        output = batch.all_token_ids[b, PROMPT_LEN:PROMPT_LEN + num_accepted].numpy()
        behind = num_accepted == 0 and int(batch.total_len[b]) > PROMPT_LEN
        if (not behind and grammar.num_processed_tokens != batch.refs[req_id].num_processed_tokens
                or not same_row_as_output(grammar, output)):
            raise AssertionError(f"{req_id}: worker grammar at {grammar.num_processed_tokens} "
                                 f"tokens, its output at {batch.refs[req_id].num_processed_tokens}")
        if req_id in emitted and list(emitted[req_id]) != trees[b][2]:
            raise AssertionError(f"{req_id}: emitted {emitted[req_id]}, "
                                 f"the target's path {trees[b][2]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a built-in model name or a directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ways", nargs="+", default=["rows", "choices"],
                        choices=["rows", "choices", "auto"],
                        help="auto: each step's way drawn at random (grammar_verify \"auto\" "
                             "switching step by step), for its checks more than its times")
    parser.add_argument("--profile", action="store_true",
                        help="also the functions where each way's time goes (cProfile)")
    parser.add_argument("--profile-sort", default="cumulative", choices=["cumulative", "tottime"],
                        help="the profile's order: tottime puts the C++ calls apart from "
                             "the Python around them")
    parser.add_argument("--chain", type=int, metavar="K",
                        help="chains of K drafts (our chain's rows) instead of trees of 16; "
                             "rows only")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    shape = Shape(1, args.chain) if args.chain else Shape()
    if shape.chain and args.ways != ["rows"]:
        parser.error(f"--chain takes --ways rows only (the target's choices need a tree's "
                     f"parents), not {args.ways}")
    from bench_grammar_walk import make_grammar_factory

    from vllm_specplug.integration.scheduler import SpecplugTreeAsyncScheduler
    from vllm_specplug.models import build_model
    from vllm_specplug.testing.scheduler_sim import make_scheduler

    model_dir = Path(args.model) if Path(args.model).is_dir() else build_model(args.model)
    vocab_size, new_grammar = make_grammar_factory(model_dir)
    vllm_config = make_scheduler(SpecplugTreeAsyncScheduler, str(model_dir),
                                 async_scheduling=True,
                                 num_speculative_tokens=shape.num_drafts).vllm_config
    results, profiles = [], {}
    for num_reqs in tqdm(args.batch, desc="batch sizes"):
        for way in args.ways:
            profiler = cProfile.Profile() if args.profile else None
            times = run_steps(vllm_config, new_grammar, vocab_size, num_reqs, way, args.steps,
                              args.seed, profiler, shape)
            row = {"batch": num_reqs, "way": way, "steps": len(times["root_bitmask"])}
            row.update({part: 1e3 * statistics.median(values) if values else 0.0
                        for part, values in times.items()})
            row["host"] = row["verification_rows"] + row["walks"] + row["root_bitmask"]
            results.append(row)
            if profiler is not None:
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats(args.profile_sort).print_stats(25)
                profiles[f"{way}-{num_reqs}"] = text.getvalue()
    lines = [f"model {args.model} (vocab {vocab_size}), JSON schema {SCHEMA_FILE.name}, "
             f"{'chains' if shape.chain else 'trees'} of {shape.num_drafts} drafts, host ms a "
             f"step (median of {args.steps} steps)",
             "| batch | way | verification_rows | walks | root_bitmask | **host** | "
             "node_choices (GPU's) | root_load (GPU's) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['way']} | {r['verification_rows']:.3f} | {r['walks']:.3f} | "
              f"{r['root_bitmask']:.3f} | **{r['host']:.3f}** | {r['node_choices']:.3f} | "
              f"{r['root_load']:.3f} |" for r in results]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grammar_step.json").write_text(json.dumps(results, indent=1))
        (args.out / "grammar_step.md").write_text("\n".join(lines) + "\n")
        for name, text in profiles.items():
            (args.out / f"profile_{name}.txt").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
