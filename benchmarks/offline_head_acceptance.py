"""Our EAGLE-3 head's chain drafting measured without an engine: per-position
acceptance against the target's own greedy continuations.

    python benchmarks/offline_head_acceptance.py --target DIR --head DIR \\
        --prompts mt-bench --num-prompts 40 --max-tokens 128 \\
        --variants bf16 bf16-compiled fp32 [--device cuda] [--cuda-graphs] [--out FILE.json]
        [--speculator '{"topk": 1, "num_steps": 5}' --speculator-dtype bf16 --speculator-batch 1]

The target (a Hugging Face Llama directory, run in float32 by transformers)
writes each prompt's greedy answer (first turns only); its hidden states at
the head's auxiliary layers fill the head's cache. Then at every position t
of the answer, as a decoding engine would after verifying t: the head
ingests position t - 1 (the target's hidden state there and token t), drafts
a chain of `--num-drafts` from token t (`HeadRuntime.draft_trees`, top-1,
the pass Model Runner V2 replays), and a draft counts as accepted while it
and every draft before it equal the target's tokens t + 1, t + 2, ...
(greedy verification, arXiv 2401.15077). τ = 1 + the accepted drafts a step.
(The hidden states come from transformers in this process, not from
`vllm-specplug extract`, which starts an engine and writes shards: here a
few dozen prompts are wanted at once, in float32, and nothing kept.)

Each variant is `<dtype>[-compiled][-torch|-triton]`: the head's weights and
activations in bf16 or fp32, its dense steps through `torch.compile`
(`draft_compile`), and its attention on the PyTorch path or our Triton
kernel (by default what the device picks: Triton on CUDA). With
`--cuda-graphs` the passes run as captured graphs, as in the engine (where
compiled steps serve captured passes only).

`--speculator JSON` (our head's options; repeat) also drafts through
`SpecplugV2HeadSpeculator` as Model Runner V2 drives it
(`tests/v2_head_driver.py`: prefill and decode steps, V2's batch fields; on
CUDA its graphs, Triton kernels and compiled steps), verified at the
engine's own steps, beside a plain runtime on the PyTorch path fed the same
verified positions: rows `speculator ...` and `reference ...`, and the steps
whose drafts differ.

What it separates: the head's drafting math (the same code in both runners)
from an engine's integration around it. On 2026-12-04 it drafted 1.68 tokens
a step on CPU with SmolLM2's GPU-built head, compiled or not, where the
H200's engine gave our chain 1.56-1.63 and vLLM's `eagle3` 1.63-1.70
(docs/results/smollm2_sets_large_h200). EAGLE-3 heads only.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Variant:
    name: str
    dtype: torch.dtype
    compiled: bool
    backend: str  # "auto", "torch" or "triton"


def parse_variant(text: str) -> Variant:
    """`bf16-compiled-triton` -> Variant; a clear error naming the part."""
    dtype, *flags = text.split("-")
    if dtype not in DTYPES:
        raise ValueError(f"--variants {text}: starts with a dtype, one of "
                         f"{', '.join(DTYPES)} (e.g. bf16-compiled)")
    unknown = [f for f in flags if f != "compiled" and f not in BACKENDS]
    backends = [f for f in flags if f in BACKENDS]
    if unknown or len(backends) > 1 or len(set(flags)) != len(flags):
        raise ValueError(f"--variants {text}: after the dtype, 'compiled' and at most one of "
                         f"{', '.join(BACKENDS)}, each once (e.g. bf16-compiled-triton)")
    return Variant(text, DTYPES[dtype], "compiled" in flags,
                   backends[0] if backends else "auto")


@dataclass
class Continuation:
    token_ids: torch.Tensor   # [T] int64: prompt, then the greedy answer
    aux_hidden: torch.Tensor  # [T, L * H] float32: the target's auxiliary layers
    prompt_len: int


def _prompt_ids(prompt, tokenizer) -> list[int]:
    request = prompt.input_for(tokenizer, 0)
    if isinstance(request, str):
        return tokenizer(request)["input_ids"]
    return list(request["prompt_token_ids"])


@torch.inference_mode()
def continuations(target_dir: str, prompts, aux_layer_ids, max_tokens: int,
                  device: str) -> tuple[list[Continuation], torch.nn.Module]:
    """Each prompt's greedy answer by the target in float32, with its hidden
    states at `aux_layer_ids` (vLLM's auxiliary layer i is the input of
    decoder layer i: Hugging Face's `hidden_states[i]`), and the target's
    embedding (the head shares it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model = model.to(device).eval()
    found = []
    for prompt in tqdm(prompts, desc="target", unit="prompt"):
        ids = torch.tensor([_prompt_ids(prompt, tokenizer)], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_tokens, do_sample=False)
        states = model(out, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in aux_layer_ids], -1)
        found.append(Continuation(out[0].cpu(), aux.float().cpu(), ids.shape[1]))
    return found, model.get_input_embeddings()


def _runtime(head_dir: str, embed, variant: Variant, device: str, cuda_graphs: bool):
    from vllm_specplug.draft_models.eagle3_model import Eagle3Head
    from vllm_specplug.proposers.draft_layers import cast_parameters
    from vllm_specplug.proposers.eagle3_head import HeadRuntime

    head = cast_parameters(Eagle3Head.from_pretrained(head_dir).to(device).eval(),
                           variant.dtype)
    return HeadRuntime(head, lambda ids: embed(ids).to(variant.dtype),
                       cuda_graphs=cuda_graphs, attention_backend=variant.backend,
                       compile_steps=variant.compiled)


@torch.inference_mode()
def accepted_positions(runtime, found: list[Continuation], num_drafts: int,
                       device: str, desc: str) -> tuple[np.ndarray, int]:
    """[num_drafts] drafts accepted at each position, summed, and the number
    of drafting steps (see the module docstring)."""
    accepted, num_steps = np.zeros(num_drafts, dtype=np.int64), 0
    dtype = runtime.layer.dtype
    for r, seq in enumerate(tqdm(found, desc=desc, unit="prompt")):
        req_id, tokens = f"r{r}", seq.token_ids.to(device)
        hidden = seq.aux_hidden.to(device, dtype)
        first = seq.prompt_len - 1
        runtime.ingest(req_id, hidden[:first], tokens[1:first + 1],
                       torch.arange(first, device=device))
        for t in range(first, len(tokens) - num_drafts - 1):
            if t > first:  # the position verified since the last step
                runtime.ingest(req_id, hidden[t - 1:t], tokens[t:t + 1],
                               torch.tensor([t - 1], device=device))
            tree = runtime.draft_trees([req_id], tokens[t:t + 1],
                                       torch.tensor([t], device=device), 1, num_drafts,
                                       num_drafts + 1)
            hits = (tree.token_ids[0, 1:] == tokens[t + 1:t + 1 + num_drafts]).long()
            accepted += hits.cumprod(0).cpu().numpy()
            num_steps += 1
        runtime.forget(req_id)
    return accepted, num_steps


def measure(args) -> list[dict]:
    from vllm_specplug.cli.bench_inputs import load_prompts
    from vllm_specplug.draft_models.eagle3_model import Eagle3Head

    variants = [parse_variant(v) for v in args.variants]
    aux_ids = Eagle3Head.from_pretrained(args.head).config.aux_layer_ids
    prompts = load_prompts(args.prompts, args.num_prompts)
    found, embed = continuations(args.target, prompts, aux_ids, args.max_tokens, args.device)
    rows = through_speculator(args, found, embed) if args.speculator else []
    for variant in variants:
        started = time.perf_counter()
        runtime = _runtime(args.head, embed, variant, args.device, args.cuda_graphs)
        accepted, steps = accepted_positions(runtime, found, args.num_drafts, args.device,
                                             variant.name)
        per_position = (accepted / max(steps, 1)).tolist()
        rows.append({"variant": variant.name, "num_steps": steps,
                     "tau": 1 + sum(per_position), "per_position": per_position,
                     "seconds": time.perf_counter() - started})
    return rows


def through_speculator(args, found, embed) -> list[dict]:
    """Each `--speculator` spec (our head's options) drafting through
    `SpecplugV2HeadSpeculator` as Model Runner V2 drives it
    (`tests/v2_head_driver.py`: its graphs, kernels and compiled steps on
    CUDA), the drafts verified at the engine's steps, beside a plain runtime
    on the PyTorch path fed the same verified positions."""
    from tests.v2_head_driver import HeadEngine, Turn

    rows = []
    for text in args.speculator:
        spec = json.loads(text)
        started = time.perf_counter()
        engine = HeadEngine(args.head, lambda ids: embed(ids.long()), embed.num_embeddings,
                            found, spec, DTYPES[args.speculator_dtype], device=args.device)
        turns = [Turn(r, f"r{r}", c.prompt_len, len(c.token_ids)) for r, c in enumerate(found)]
        size = args.speculator_batch or len(turns)
        for first in range(0, len(turns), size):  # batches of `size` requests, one after another
            engine.serve(turns[first:first + size])
        for name, accepted in (("speculator", engine.accepted),
                               ("reference", engine.reference_accepted)):
            per_position = (accepted / max(engine.num_steps, 1)).tolist()
            rows.append({"variant": f"{name} {text}", "num_steps": engine.num_steps,
                         "tau": 1 + sum(per_position), "per_position": per_position,
                         "num_differing": engine.num_differing,
                         "seconds": time.perf_counter() - started})
    return rows


def _json_object(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def table(rows: list[dict]) -> str:
    width = max(24, *(len(row["variant"]) + 2 for row in rows))
    lines = [f"{'variant':{width}}{'steps':>7}{'tau':>8}  per-position acceptance", "-" * 72]
    for row in rows:
        lines.append(f"{row['variant']:{width}}{row['num_steps']:>7}{row['tau']:>8.4f}  "
                     + " ".join(f"{p:.4f}" for p in row["per_position"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the target's model directory")
    parser.add_argument("--head", required=True, help="an EAGLE-3 head directory of ours")
    parser.add_argument("--prompts", default="mt-bench", help="a set as `bench offline` "
                        "takes it (public, built-in or JSONL); first turns only")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-drafts", type=int, default=5)
    parser.add_argument("--variants", nargs="*", default=["bf16", "bf16-compiled"])
    parser.add_argument("--speculator", action="append", default=[], metavar="JSON",
                        help="our head's options (e.g. '{\"topk\": 1, \"num_steps\": 5}'): "
                        "drafting through the Model Runner V2 speculator at the engine's "
                        "steps, beside the PyTorch path fed the same positions (repeat)")
    parser.add_argument("--speculator-dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--speculator-batch", type=int, default=0, metavar="N",
                        help="the speculator serves the prompts N at a time (default: all "
                        "in one batch)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the head's passes as CUDA graphs (CUDA only)")
    parser.add_argument("--out", default=None, help="a JSON file for the rows")
    args = parser.parse_args(argv)
    try:
        for variant in args.variants:
            parse_variant(variant)
        for text in args.speculator:
            if not isinstance(_json_object(text), dict):
                raise ValueError(f"--speculator {text}: a JSON object of our head's options")
        if args.cuda_graphs and not args.device.startswith("cuda"):
            raise ValueError("--cuda-graphs needs --device cuda")
    except ValueError as error:
        parser.error(str(error))
    rows = measure(args)
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "rows": rows},
                                             indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
