"""The grammar's own cost per draft tree (issue 30): what the scheduler spends
on the host to check every node of a tree and fill its verification row,
for each way of walking it, under the JSON schema of benchmarks/json_schema.json:

    .venv/bin/python benchmarks/bench_grammar_walk.py --model tiny --out docs/results/grammar_walk_cpu

- `validate`: the walk before this change: each child validated (an accept
  and a rollback), then accepted; vLLM's fill for each valid node.
- `bit-test`: each child tested on its parent's filled row (one bit), then
  accepted; what other backends than xgrammar run (`walk_tree(rows=...)`).
- `native`: xgrammar's `GrammarMatcher.traverse_draft_tree`, one C++ call a
  tree (`fill_tree_rows`).

Trees are random (each node's parent drawn among the earlier nodes), their
drafts valid on their path with probability `--valid`, from grammar states
reached by a random valid prefix, as a drafter near a good target produces.
Every walk must give the same rows, bit for bit, or the script fails.
Reported: microseconds per tree (median of `--repeats` passes over the
same trees) and per valid node.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

SCHEMA_FILE = Path(__file__).with_name("json_schema.json")


def make_grammar_factory(model_dir: Path):
    """() -> a fresh vLLM `XgrammarGrammar` under the schema, on the model's tokenizer."""
    import xgrammar as xgr
    from transformers import AutoConfig, AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        SCHEMA_FILE.read_text(), any_whitespace=False)
    return vocab_size, lambda: XgrammarGrammar(vocab_size=vocab_size,
                                               matcher=xgr.GrammarMatcher(compiled),
                                               ctx=compiled)


def allowed_tokens(grammar, vocab_size: int) -> list[int]:
    import xgrammar as xgr

    if grammar.is_terminated():
        return []
    row = xgr.allocate_token_bitmask(1, vocab_size)
    grammar.fill_bitmask(row, 0)
    bits = row[0].numpy().view("uint32")
    return [t for t in range(vocab_size) if (int(bits[t >> 5]) >> (t & 31)) & 1]


def random_case(rng, new_grammar, vocab_size: int, num_nodes: int, p_valid: float):
    """(prefix, parents, drafts): a random valid prefix, then a random tree."""
    grammar, prefix = new_grammar(), []
    for _ in range(rng.randrange(40)):
        choices = allowed_tokens(grammar, vocab_size)
        if not choices:
            break
        token = rng.choice(choices)
        if token in grammar.matcher.stop_token_ids:
            continue
        grammar.accept_tokens("case", [token])
        prefix.append(token)
    parents, drafts, paths = [-1], [], [[]]
    for node in range(1, num_nodes):
        parent = rng.randrange(node)
        path_grammar = new_grammar()
        ok = path_grammar.accept_tokens("case", prefix + paths[parent])
        choices = allowed_tokens(path_grammar, vocab_size) if ok else []
        token = (rng.choice(choices) if choices and rng.random() < p_valid
                 else rng.randrange(vocab_size))
        parents.append(parent)
        drafts.append(token)
        paths.append(paths[parent] + [token])
    return prefix, parents, drafts


def walk(kind: str, grammar, parents, drafts, rows) -> list[bool]:
    from vllm_specplug.integration.grammar_trees import fill_tree_rows, walk_tree

    def fill(node: int) -> None:
        if grammar.is_terminated():
            rows[node].fill_(-1)
        else:
            grammar.fill_bitmask(rows, node)

    if kind == "native":
        return fill_tree_rows(grammar, "bench", drafts, parents, rows, fill)
    valid = walk_tree(grammar, "bench", drafts, parents, fill,
                      rows if kind == "bit-test" else None)
    for node in range(1, len(parents)):
        if not valid[node]:
            rows[node].copy_(rows[parents[node]])
    return valid


def measure(new_grammar, vocab_size: int, cases, repeats: int) -> dict:
    """{kind: (median µs per tree, µs per valid node)}; rows compared bit for bit."""
    import torch
    import xgrammar as xgr

    kinds = ["validate", "bit-test", "native"]
    grammars = []
    for prefix, _, _ in cases:
        grammar = new_grammar()
        assert grammar.accept_tokens("bench", prefix)
        grammars.append(grammar)
    rows = {kind: [xgr.allocate_token_bitmask(len(c[1]), vocab_size) for c in cases]
            for kind in kinds}
    times = {kind: [] for kind in kinds}
    for _ in tqdm(range(repeats), desc="passes", leave=False):
        for kind in kinds:  # interleaved: one pass of each kind in turn
            start = time.perf_counter()
            for grammar, (_, parents, drafts), out in zip(grammars, cases, rows[kind]):
                walk(kind, grammar, parents, drafts, out)
            times[kind].append(time.perf_counter() - start)
    num_valid = sum(sum(walk("native", g, c[1], c[2], r))
                    for g, c, r in zip(grammars, cases, rows["native"]))
    for kind in kinds[1:]:
        for want, got in zip(rows["validate"], rows[kind]):
            assert torch.equal(want, got), f"{kind} rows differ from the validating walk"
    return {kind: (statistics.median(t) / len(cases) * 1e6,
                   statistics.median(t) / num_valid * 1e6) for kind, t in times.items()}


def greedy_choices(rng, cases, rows, p_follow: float = 0.6, p_forbidden: float = 0.05):
    """Each case's `NodeChoices` for `GreedyGrammarWalk` (greedy verification
    from the target's unmasked choices, verification/grammar_greedy.py), made
    from its rows (the serial walk's): at a valid node, the argmax is its
    first valid child's draft with probability `p_follow` (drafts accepted as
    a good head's are), else another token its row allows; with probability
    `p_forbidden` a forbidden token lies above it (the second of the top-2)."""
    from vllm_specplug.verification.grammar_greedy import NodeChoices, unpack_row

    found = []
    for (_, parents, drafts), case_rows in zip(cases, rows):
        num_nodes, vocab_size = len(parents), case_rows.shape[1] * 32
        allowed = [unpack_row(case_rows[n].numpy(), vocab_size) for n in range(num_nodes)]
        tokens = [0, *drafts]
        valid = [True] + [False] * (num_nodes - 1)
        for node in range(1, num_nodes):
            valid[node] = valid[parents[node]] and bool(allowed[parents[node]][tokens[node]])
        argmax, second = np.zeros(num_nodes, np.int64), np.zeros(num_nodes, np.int64)
        for node in range(num_nodes):
            kids = [c for c in range(1, num_nodes) if parents[c] == node and valid[c]]
            ids = np.flatnonzero(allowed[node])
            pick = (tokens[kids[0]] if kids and rng.random() < p_follow
                    else int(rng.choice(ids.tolist())) if len(ids) else 0)
            forbidden = np.flatnonzero(~allowed[node])
            if len(forbidden) and rng.random() < p_forbidden:
                argmax[node], second[node] = int(rng.choice(forbidden.tolist())), pick
            else:
                argmax[node], second[node] = pick, (pick + 1) % vocab_size
        logits = np.tile(np.array([2.0, 1.0, 0.0], np.float32), (num_nodes, 1))
        top = np.stack([argmax, second, (second + 1) % vocab_size], axis=1)
        found.append(NodeChoices(argmax, top, logits))
    return found


def rows_walk(tokens: list[int], parents: list[int], rows, choices) -> tuple[list, list]:
    """The accepted path over every node's row (the serial walk's), with
    `greedy_choices`' logits (the argmax, else the allowed second): what
    the greedy way must give."""
    from vllm_specplug.verification.grammar_greedy import unpack_row
    from vllm_specplug.verification.tree_greedy import follow_choices

    def choose(node: int) -> int:
        allowed = unpack_row(rows[node].numpy(), rows.shape[1] * 32)
        argmax = int(choices.argmax_ids[node])
        return argmax if allowed[argmax] else int(choices.top_ids[node, 1])

    return follow_choices(parents, tokens, choose)


def measure_step(new_grammar, cases, repeats: int, workers: int) -> dict[str, float]:
    """{way: ms} for one step's walks, every case a request of the step,
    native walk: on one thread (`serial`), whole fills on `workers` threads
    (`fills`: Python included, as this script first tried), and the worker's
    way (`walks`: xgrammar's walks alone on `workers` threads, the bookkeeping
    on this one: `RowThreads`, integration/row_threads.py), and the
    worker's way for a step of equal trees (`step`: their bookkeeping at
    once, integration/tree_walks.py, the walks on the threads). Every way
    must give the serial rows, bit for bit. And `greedy`: no rows, each
    request's accepted path from the target's unmasked choices
    (`greedy_choices`), on one thread: the host's grammar work of greedy
    verification decided that way (verification/grammar_greedy.py), without
    the copy of those choices from the device that it needs."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import xgrammar as xgr

    from vllm_specplug.integration.grammar_trees import fill_tree_rows
    from vllm_specplug.integration.row_threads import RowThreads
    from vllm_specplug.integration.tree_walks import plan_tree_walks
    from vllm_specplug.integration.worker_rows import plan_request_rows
    from vllm_specplug.verification.grammar_greedy import GreedyGrammarWalk

    grammars = []
    for prefix, _, _ in cases:
        grammar = new_grammar()
        assert grammar.accept_tokens("bench", prefix)
        grammars.append(grammar)
    vocab_size = grammars[0].vocab_size
    flat = xgr.allocate_token_bitmask(sum(len(c[1]) for c in cases), vocab_size)
    offsets = np.cumsum([0] + [len(c[1]) for c in cases])
    rows = [flat[offsets[i]:offsets[i + 1]] for i in range(len(cases))]  # the step's one bitmask
    jobs = [(g, "bench", c[2], c[1], r, lambda node, g=g, r=r: g.fill_bitmask(r, node))
            for g, c, r in zip(grammars, cases, rows)]
    row_threads = RowThreads(workers, min_rows=0)  # 1 worker: request after request

    def serial():
        for job in jobs:
            fill_tree_rows(*job)

    def fills():
        for future in [pool.submit(fill_tree_rows, *job) for job in jobs]:
            future.result()

    def walks():
        row_threads.fill(lambda i: plan_request_rows(grammars[i], "bench", rows[i],
                                                     cases[i][2], cases[i][1]),
                         [len(c[1]) for c in cases])

    def step():
        walks = plan_tree_walks(grammars, [c[2] for c in cases], [c[1] for c in cases], flat)
        row_threads.run(walks.jobs, [len(c[1]) for c in cases])
        walks.finish()

    def greedy():
        for grammar, (_, parents, drafts), walk in zip(grammars, cases, greedy_walks):
            walk.run([0, *drafts], parents)

    serial()
    all_choices = greedy_choices(random.Random(0), cases, [r.clone() for r in rows])
    greedy_walks = [GreedyGrammarWalk(g, vocab_size, choices, lambda node: None)
                    for g, choices in zip(grammars, all_choices)]
    for walk, (_, parents, drafts), case_rows, choices in zip(greedy_walks, cases, rows,
                                                               all_choices):
        expected = rows_walk([0, *drafts], parents, case_rows, choices)
        got = walk.run([0, *drafts], parents)
        assert (got.accepted_node_ids, got.output_token_ids) == expected, "greedy walk"
    times: dict[str, list[float]] = {"serial": [], "fills": [], "walks": [], "step": [],
                                     "greedy": []}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in range(repeats):  # interleaved
            for name, way in (("serial", serial), ("fills", fills), ("walks", walks),
                              ("step", step), ("greedy", greedy)):
                for r in rows:
                    r.zero_()
                start = time.perf_counter()
                way()
                times[name].append(time.perf_counter() - start)
                if name == "serial":
                    expected = [r.clone() for r in rows]
                elif name != "greedy":
                    assert all(torch.equal(a, b) for a, b in zip(rows, expected)), name
    row_threads.shutdown()
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a built-in model name or a directory")
    parser.add_argument("--nodes", type=int, nargs="+", default=[6, 16, 32, 64])
    parser.add_argument("--trees", type=int, default=64, help="trees per size")
    parser.add_argument("--valid", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-batch", type=int, default=64,
                        help="requests of one step for the serial vs threaded walk")
    parser.add_argument("--workers", type=int, default=8,
                        help="threads for a step's trees (grammar_row_threads)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from vllm_specplug.models import build_model

    model_dir = Path(args.model) if Path(args.model).is_dir() else build_model(args.model)
    vocab_size, new_grammar = make_grammar_factory(model_dir)
    rng, results = random.Random(args.seed), []
    for num_nodes in args.nodes:
        cases = [random_case(rng, new_grammar, vocab_size, num_nodes, args.valid)
                 for _ in tqdm(range(args.trees), desc=f"{num_nodes}-node trees")]
        results.append({"nodes": num_nodes, **{k: v for k, v in zip(
            ("validate", "bit-test", "native"),
            measure(new_grammar, vocab_size, cases, args.repeats).values())}})
    lines = [f"model {args.model} (vocab {vocab_size}), JSON schema {SCHEMA_FILE.name}, "
             f"{args.trees} random trees a size, drafts valid on their path with p={args.valid}, "
             f"median of {args.repeats} interleaved passes",
             "| nodes | validate µs/tree (µs/valid node) | bit-test | native | native vs validate |",
             "| --- | --- | --- | --- | --- |"]
    for row in results:
        cells = [f"{row[k][0]:.0f} ({row[k][1]:.1f})" for k in ("validate", "bit-test", "native")]
        lines.append(f"| {row['nodes']} | {' | '.join(cells)} | "
                     f"{row['validate'][0] / row['native'][0]:.1f}x |")
    step_cases = [random_case(rng, new_grammar, vocab_size, 16, args.valid)
                  for _ in tqdm(range(args.step_batch), desc="a step's trees")]
    step = measure_step(new_grammar, step_cases, args.repeats, args.workers)
    lines.append(f"\none step of {args.step_batch} 16-node trees, native walk: "
                 f"{step['serial']:.2f} ms on one thread; on {args.workers} threads, whole "
                 f"fills {step['fills']:.2f} ms ({step['serial'] / step['fills']:.1f}x), "
                 f"the walks alone (RowThreads) {step['walks']:.2f} ms "
                 f"({step['serial'] / step['walks']:.1f}x), the step's trees at once "
                 f"(tree_walks.py, the walks on the threads) {step['step']:.2f} ms "
                 f"({step['serial'] / step['step']:.1f}x); greedy verification's paths "
                 f"from the target's unmasked choices, no rows (grammar_greedy.py, one "
                 f"thread, the choices' copy from the device not included) "
                 f"{step['greedy']:.2f} ms ({step['serial'] / step['greedy']:.1f}x)")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"walk_{Path(args.model).name}.txt").write_text("\n".join(lines) + "\n")
        (args.out / f"walk_{Path(args.model).name}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
