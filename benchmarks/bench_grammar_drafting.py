"""Does a grammar-aware drafter pay? (issue 30, item 2): the tree's top-k at
each node taken from the tokens the grammar allows on that node's path,
against top-k over the whole vocabulary (vLLM's drafters, and ours with
`grammar_drafts: false`; the scheduler then prunes invalid nodes before
verification).

No engine: the built-in tiny model in transformers is the target, its
`tiny-eagle3` head drafts through our head runtime (`HeadRuntime`, with
`tree_logits_hook` masking each step's logits with the engine's masks,
`integration/grammar_drafting.PathMasks`), and xgrammar holds the JSON
schema of `bench_grammar_trees.py`. For each held-out prompt the target's
greedy output under the schema is generated first; then decoding is
replayed step by step as the V1 runner does it: the head ingests the
verified positions (the target's aux hidden states, vLLM's layout), drafts
from the last verified token, the longest path of the draft that matches
the target's own tokens is accepted, plus one token. Greedy, so the
accepted length per step is what an engine with the same target and head
would see (the scheduler's pruning never cuts a node on the target's path).

    .venv/bin/python benchmarks/bench_grammar_drafting.py --out docs/results/grammar_drafting_cpu

`--shape NAME=K,S,N` (repeatable) replays other shapes, `--variants` a
subset of the replays (none,masked,first-masked,free).

Reports per draft shape, under the schema unmasked, masked at every step,
and masked at the first step only (the root's row: what one read of the
sampled tokens would give a graphed pass), and without a schema (the same
prompts, the target's own greedy output): tokens per step (the accepted
length plus one), and the grammar's own time per drafting
pass (xgrammar driven from Python here, node by node: an upper bound of
what a batched walk would cost).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench_grammar_trees import SCHEMA

# topk, num_steps, num_draft_tokens
SHAPES = {"tree16": (4, 4, 16), "tree16-deep": (2, 8, 16), "chain5": (1, 5, 6)}


class TimedMasks:
    """The engine's masks (`integration/grammar_drafting.PathMasks`) over one
    request's grammar (vLLM's `XgrammarGrammar`, after the request's
    verified tokens), and the time they take."""

    def __init__(self, xgr, compiled, vocab_size: int, draft_to_target: torch.Tensor,
                 first_step_only: bool = False):
        from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

        from vllm_specplug.integration.grammar_drafting import PathMasks

        self.grammar = XgrammarGrammar(vocab_size=vocab_size, ctx=compiled,
                                       matcher=xgr.GrammarMatcher(compiled))
        # first_step_only: the root's row alone (`grammar_drafts: "first"`)
        self.masks = PathMasks(["r"], [self.grammar], draft_to_target,
                               lambda rows: xgr.allocate_token_bitmask(rows, vocab_size),
                               first_step_only)
        self.seconds = 0.0

    def accept(self, token: int) -> None:
        self.grammar.accept_tokens("r", [token])

    def __call__(self, *args) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return self.masks(*args)
        finally:
            self.seconds += time.perf_counter() - started


def greedy_under_schema(model, xgr, compiled, prompt_ids: list[int], max_tokens: int):
    """The target's greedy tokens under the grammar (none: `compiled` None)."""
    if compiled is None:
        return greedy(model, prompt_ids, max_tokens)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, model.config.vocab_size)
    inputs, past, output = torch.tensor([prompt_ids]), None, []
    with torch.inference_mode():
        for _ in range(max_tokens):
            result = model(inputs, past_key_values=past, use_cache=True)
            past, logits = result.past_key_values, result.logits[:, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            output.append(token)
            if matcher.is_terminated():
                break
            inputs = torch.tensor([[token]])
    return output


def greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The target's greedy tokens without a grammar."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                             do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def aux_hidden(model, ids: list[int], layer_ids) -> torch.Tensor:
    """[T, L * H]: vLLM's EAGLE-3 aux hidden states (the input of layer l,
    residual included, is transformers' hidden_states[l])."""
    with torch.inference_mode():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[layer][0] for layer in layer_ids], -1)


def replay(runtime, aux, ids: list[int], num_prompt: int, shape, masks: TimedMasks | None):
    """Tokens per step (accepted + 1) over the output, drafting with `shape`."""
    runtime.forget("r")
    runtime.tree_logits_hook = masks
    runtime.ingest("r", aux[:num_prompt], torch.tensor(ids[1:num_prompt + 1]),
                   torch.arange(num_prompt))
    root, steps = num_prompt, []
    if masks is not None:
        masks.accept(ids[root])
    while root < len(ids) - 1:
        tree = runtime.draft_trees(["r"], torch.tensor([ids[root]]), torch.tensor([root]),
                                   *shape)
        accepted = _accepted(tree, ids, root)
        steps.append(accepted + 1)
        new = list(range(root, min(root + accepted + 1, len(ids) - 1)))
        if new:
            runtime.ingest("r", aux[new], torch.tensor([ids[t + 1] for t in new]),
                           torch.tensor(new))
        for t in range(root + 1, min(root + accepted + 2, len(ids))):
            if masks is not None:
                masks.accept(ids[t])
        root += accepted + 1
    runtime.tree_logits_hook = None
    return steps


def _accepted(tree, ids: list[int], root: int) -> int:
    """Length of the longest draft path equal to the target's next tokens."""
    tokens, parents = tree.token_ids[0].tolist(), tree.parent_ids[0].tolist()
    node, depth = 0, 0
    while root + depth + 1 < len(ids):
        children = [c for c in range(1, len(tokens))
                    if parents[c] == node and tokens[c] == ids[root + depth + 1]]
        if not children:
            break
        node, depth = children[0], depth + 1
    return depth


# --variants: (constraint, masks) of each replay
VARIANTS = {"none": ("schema", ""), "masked": ("schema", "masked"),
            "first-masked": ("schema", "first-masked"), "free": ("none", "")}


def _shape(text: str) -> tuple[str, tuple[int, int, int]]:
    """"NAME=K,S,N" -> (NAME, (topk, num_steps, num_draft_tokens))."""
    name, _, numbers = text.partition("=")
    values = tuple(int(v) for v in numbers.split(","))
    if not name or len(values) != 3:
        raise SystemExit(f"--shape {text!r}: expected NAME=topk,num_steps,num_draft_tokens")
    return name, values


def _label(name: str, constraint: str, masked: str) -> str:
    """masked: "" (no masks), "masked" (every step), "first-masked" (the first step's)."""
    return f"{name} {constraint}{' ' + masked if masked else ''}"


def _add(row: dict, steps: list[int], masks: TimedMasks | None) -> None:
    row["steps"] += steps
    row["passes"] += len(steps)
    row["seconds"] += masks.seconds if masks is not None else 0.0


def workload(target: str, num_prompts: int):
    """(model dir, head dir, tokenizer -> prompts' token ids, schema): the
    tiny model, its head and held-out code prompts under SCHEMA; or SmolLM2
    (fp32), `smollm2-eagle3-demo` and the `mt-bench-json` chats under
    their schema (what `bench offline --prompts mt-bench-json` runs)."""
    from vllm_specplug.models import build_model, held_out_prompts
    from vllm_specplug.models.heads import build_head

    if target == "tiny":
        texts = held_out_prompts(num_prompts)
        return (build_model("tiny"), build_head("tiny-eagle3"),
                lambda tokenizer: [tokenizer(t).input_ids for t in texts], SCHEMA)
    from vllm_specplug.bench.sets import load_public_set
    from vllm_specplug.models.smollm2 import build_smollm2

    chats = load_public_set("mt-bench-json", num_prompts)
    return (build_smollm2("float32"), build_head("smollm2-eagle3-demo"),
            lambda tokenizer: [p.input_for(tokenizer)["prompt_token_ids"] for p in chats],
            json.loads(chats[0].json_schema))


def main(argv: list[str] | None = None) -> int:
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specplug.proposers.eagle3_head import HeadRuntime
    from vllm_specplug.proposers.eagle3_loading import load_head

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--shape", action="append", default=[], metavar="NAME=K,S,N",
                        help="a draft shape (topk, num_steps, num_draft_tokens), repeatable; "
                             f"given, it replaces the defaults {SHAPES}")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"which of {','.join(VARIANTS)} to replay")
    args = parser.parse_args(argv)
    shapes = dict(_shape(text) for text in args.shape) or SHAPES
    chosen = [VARIANTS[name] for name in args.variants.split(",")]
    model_dir, head_dir, prompts, schema = workload(args.target, args.prompts)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab_size = model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    head = load_head(head_dir).eval()
    runtime = HeadRuntime(head, model.get_input_embeddings())
    draft_to_target = runtime.layer.to_target(torch.arange(runtime.layer.logits_size))
    variants = [(name, constraint, masked) for name in shapes for constraint, masked in chosen]
    rows = {_label(*v): {"steps": [], "seconds": 0.0, "passes": 0}
            for v in variants}
    for prompt_ids in tqdm(prompts(tokenizer), desc="prompts"):
        for constraint in sorted({c for _, c, _ in variants}, reverse=True):
            output = greedy_under_schema(model, xgr, compiled if constraint == "schema" else None,
                                         prompt_ids, args.max_tokens)
            ids = prompt_ids + output
            aux = aux_hidden(model, ids, head.config.aux_layer_ids)
            for name, _, masked in (v for v in variants if v[1] == constraint):
                masks = (TimedMasks(xgr, compiled, vocab_size, draft_to_target,
                                    first_step_only=masked == "first-masked")
                         if masked else None)
                steps = replay(runtime, aux, ids, len(prompt_ids), shapes[name], masks)
                _add(rows[_label(name, constraint, masked)], steps, masks)
    summary = {name: {"tokens_per_step": float(np.mean(r["steps"])), "steps": len(r["steps"]),
                      "grammar_ms_per_pass": 1e3 * r["seconds"] / max(r["passes"], 1)}
               for name, r in rows.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar_drafting.json").write_text(json.dumps(
        {"target": args.target, "schema": schema, "prompts": args.prompts,
         "max_tokens": args.max_tokens,
         "rows": summary}, indent=1))
    lines = [f"{'draft':26} {'tokens/step':>12} {'steps':>6} {'grammar ms/pass':>16}"]
    lines += [f"{n:26} {s['tokens_per_step']:12.2f} {s['steps']:6d} "
              f"{s['grammar_ms_per_pass']:16.2f}" for n, s in summary.items()]
    (args.out / "grammar_drafting.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
