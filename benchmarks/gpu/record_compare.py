"""`record_propose.py compare`: two engines' recordings of the same greedy
prompts, side by side, request by request (a batch's steps split by request;
an engine's request id matched to its prompt by the tokens of its first rows).

A step's root is the position of the token it drafts from (the last one
sampled): its first row's position plus its rows less the rejected ones. A
draft at depth d is accepted while it and every draft before it equal the
output's tokens after the root (greedy verification).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

# what `record_propose.Recorder` keeps of each `propose` call
FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "num_sampled",
          "num_rejected", "last_sampled", "aux", "drafts")


@dataclass
class Prompt:
    """One prompt's recording: its tokens (prompt then output) and, by root
    position, the drafts made there and the target's rows handed over."""
    token_ids: np.ndarray                                          # [T] int64
    drafts: dict[int, np.ndarray] = field(default_factory=dict)    # root -> [K] int64
    rows: dict[int, torch.Tensor] = field(default_factory=dict)    # position -> [L * H]


def load(directory: Path, name: str) -> dict[str, Prompt]:
    """Every request of recording `name` (NAME.json, NAME.rR.safetensors), by
    its key (rR.pP.tT: repeat, prompt, turn)."""
    from safetensors.torch import load_file

    meta = json.loads((directory / f"{name}.json").read_text())
    tensors = {}
    for path in sorted(directory.glob(f"{name}.r*.safetensors")):
        tensors.update(load_file(str(path)))
    found = {}
    for wave in meta["waves"]:
        prompts = {r["key"]: Prompt(np.asarray(r["prompt_token_ids"] + r["output_token_ids"]))
                   for r in wave["requests"]}
        owner: dict[str, str] = {}  # the engine's request id -> its key
        for i, req_ids in enumerate(wave["req_ids"]):
            step = {f: tensors[f"{wave['key']}.{i:05d}.{f}"] for f in FIELDS}
            for j, req_id in enumerate(req_ids):
                key = owner.get(req_id) or _match(step, j, prompts, set(owner.values()))
                if key is not None:
                    owner[req_id] = key
                    _add_step(prompts[key], step, j)
        found.update(prompts)
    return found


def _match(step: dict, j: int, prompts: dict[str, Prompt], taken: set) -> str | None:
    """The request whose tokens are the step's rows of batch row `j`."""
    start, end = (int(x) for x in step["query_start_loc"][j:j + 2])
    first = int(step["positions"][start])
    ids = step["input_ids"][start:end].long().numpy()
    return next((key for key, prompt in prompts.items() if key not in taken and
                 np.array_equal(prompt.token_ids[first:first + len(ids)], ids)), None)


def _add_step(prompt: Prompt, step: dict, j: int) -> None:
    """Batch row `j` of a step: its drafts by root, its verified rows."""
    start, end = (int(x) for x in step["query_start_loc"][j:j + 2])
    positions = step["positions"][start:end].long().numpy()
    root = int(positions[0]) + (end - start) - int(step["num_rejected"][j])
    prompt.drafts[root] = step["drafts"][j].long().numpy()
    ids = step["input_ids"][start:end].long().numpy()
    if step["aux"].shape[1] == 0:  # recorded with --no-hidden
        return
    for i, position in enumerate(positions):  # the rows whose token is the sequence's
        if position < len(prompt.token_ids) and ids[i] == prompt.token_ids[position]:
            prompt.rows[int(position)] = step["aux"][start + i].float()


def accepted(prompt: Prompt, root: int) -> int:
    """Drafts at `root` accepted against the prompt's own output."""
    truth = prompt.token_ids[root + 1:]
    drafts = prompt.drafts[root][:len(truth)]
    hits = np.cumprod(drafts == truth[:len(drafts)])
    return int(hits.sum())


def compare(directory: Path, name_a: str, name_b: str) -> str:
    """A text report, a line a request: whether the outputs are the same,
    each recording's steps and τ at its own steps, the roots both drafted
    from and how often their drafts agree at each depth there, and the
    verified positions both handed the target's rows for, with the largest
    difference between them; then steps and τ of each recording over all
    requests, by turn (t0, t1) and by repeat (r0, r1), with the share of
    steps accepting each depth's draft; then, over the requests with the
    same output, where the two part by the request's step (`_parting`)."""
    a, b = load(directory, name_a), load(directory, name_b)
    lines = [f"{'request':<12}{'same out':>9}{'steps':>12}{'tau':>16}{'common':>8}"
             f"{'same drafts by depth':>28}{'rows':>7}{'max |diff|':>12}"]
    keys = [k for k in a if k in b]
    lines += [_line(key, a[key], b[key]) for key in keys]
    lines += ["", f"{'group':<12}{'steps':>14}{'tau':>16}   per position (a | b)"]
    groups = {"all": keys}
    for key in keys:  # by turn (t0, t1) and by repeat (r0, r1)
        repeat, _, turn = key.split(".")
        for group in (turn, repeat):
            groups.setdefault(group, []).append(key)
    for group, members in sorted(groups.items()):
        steps, taus = zip(*(_tau([x[k] for k in members]) for x in (a, b)))
        rates = [" ".join(f"{r:.3f}" for r in _per_position([x[k] for k in members]))
                 for x in (a, b)]
        lines.append(f"{group:<12}{steps[0]:>8}/{steps[1]:<5}{taus[0]:>8.3f}/{taus[1]:<7.3f}"
                     f"   {rates[0]} | {rates[1]}")
    return "\n".join(lines + _parting(a, b, [k for k in keys if np.array_equal(
        a[k].token_ids, b[k].token_ids)]))


BUCKETS = ("0", "1", "2", "3", "4-7", "8+")  # a request's steps, counted from its first


def _bucket(step: int) -> int:
    return min(step, 3) if step < 4 else (4 if step < 8 else 5)


def _parting(a: dict, b: dict, keys: list[str]) -> list[str]:
    """Where the two part, at the roots both drafted from in requests with the
    same output, by B's step of the request (0: the step after its prefill):
    roots, how many drafted the same first token and another second one,
    and the drafts accepted by A and by B there (a bug of one speculator's
    that bites at some step shows as a bucket of its own)."""
    counts = np.zeros((len(BUCKETS), 4), dtype=np.int64)
    for key in keys:
        for step, root in enumerate(sorted(b[key].drafts)):
            if root not in a[key].drafts:
                continue
            da, db = a[key].drafts[root], b[key].drafts[root]
            counts[_bucket(step)] += (1, int(da[0] == db[0] and len(da) > 1 and da[1] != db[1]),
                                      accepted(a[key], root), accepted(b[key], root))
    lines = ["", f"same outputs ({len(keys)} requests), by B's step of the request: "
                 "roots, depth 1 the same and depth 2 not, accepted by A / B"]
    return lines + [f"  step {name:<5}{n:>7}{apart:>8}{acc_a:>10} / {acc_b:<8}"
                    for name, (n, apart, acc_a, acc_b) in zip(BUCKETS, counts) if n]


def _tau(prompts: list[Prompt]) -> tuple[int, float]:
    """Steps and τ (1 + accepted drafts a step) over several requests."""
    steps = sum(len(q.drafts) for q in prompts)
    hits = sum(accepted(q, r) for q in prompts for r in q.drafts)
    return steps, 1 + hits / max(steps, 1)


def _per_position(prompts: list[Prompt]) -> list[float]:
    """Share of steps whose draft at each depth was accepted (vLLM's
    per-position acceptance; `bench offline` prints the same for the engine)."""
    depth = max((len(d) for q in prompts for d in q.drafts.values()), default=0)
    counts = np.zeros(depth)
    for q in prompts:
        for root in q.drafts:
            counts[:accepted(q, root)] += 1
    return list(counts / max(sum(len(q.drafts) for q in prompts), 1))


def _line(key: str, pa: Prompt, pb: Prompt) -> str:
    same_output = np.array_equal(pa.token_ids, pb.token_ids)
    taus = [_tau([q])[1] for q in (pa, pb)]
    common = sorted(set(pa.drafts) & set(pb.drafts))
    depth = min(len(pa.drafts[common[0]]), len(pb.drafts[common[0]])) if common else 0
    agree = [np.mean([pa.drafts[r][d] == pb.drafts[r][d] for r in common])
             for d in range(depth)]
    shared = sorted(set(pa.rows) & set(pb.rows))
    diff = max((float((pa.rows[i] - pb.rows[i]).abs().max()) for i in shared), default=0.0)
    return (f"{key:<12}{str(same_output):>9}{len(pa.drafts):>6}/{len(pb.drafts):<5}"
            f"{taus[0]:>8.3f}/{taus[1]:<7.3f}{len(common):>8}"
            f"{' '.join(f'{x:.2f}' for x in agree):>28}{len(shared):>7}{diff:>12.4g}")
