"""What an EAGLE-3 speculator is handed and drafts, step by step, in a real
engine on Model Runner V2 (a diagnostic, for issue 26: our chain's τ fell
to 0.95x vLLM's `eagle3` with the same head on the H200, where driving our
speculator outside an engine, on the same GPU paths, drafts what the
reference drafts: docs/results/smollm2_sets_large_h200).

    record  NAME SPEC_JSON --model DIR --out DIR [--num-prompts 4] [--max-tokens 128]
            [--no-prefix-caching]
        One engine (in this process: vLLM's engine core and worker in-process,
        so the speculator's class can be wrapped), the prompts one at a time
        (batch 1), greedy. Every non-dummy `propose` call is recorded: the
        batch's request ids, its tokens and positions, query_start_loc,
        seq_lens, num_sampled, num_rejected, the last sampled token of each
        request, the target's auxiliary hidden states of every row
        (bfloat16, [num_tokens, L * H]) and the drafts returned. One
        safetensors file a prompt: NAME.P.safetensors, plus NAME.json (the
        engine's outputs and settings).

    compare A B --dir DIR [--head DIR]
        Two recordings of the same prompts (greedy, so the same outputs):
        per prompt, the target's hidden states the two speculators were
        handed at the same positions (they should agree to bf16 rounding:
        one target), and, at the steps whose roots are the same position,
        how often their drafts agree depth by depth; each recording's τ at
        its own steps. With --head, a plain `HeadRuntime` (PyTorch path,
        float32 on this machine's CPU) fed each recording's own verified
        rows drafts beside it: where an engine's drafts part from what its
        inputs give, the speculator's step path is at fault; where both
        engines' inputs give the same drafts but their own differ, it is
        not the inputs.

Run on the staged GPU host (docs/gpu.md): `record` twice (vLLM's `eagle3`
K=5 and our chain K=5), the files fetched, `compare` here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "num_sampled",
          "num_rejected", "last_sampled", "aux", "drafts")


class Recorder:
    """Wraps a speculator class's `propose`: each real call's inputs and
    drafts copied to the host (a sync a step: speed is not measured here)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def wrap(self, cls) -> None:
        original = cls.propose
        recorder = self

        def propose(speculator, *args, **kwargs):
            drafts = original(speculator, *args, **kwargs)
            if args and not kwargs.get("dummy_run", False):
                recorder.record(args, drafts)
            return drafts

        cls.propose = propose

    def record(self, args, drafts: torch.Tensor) -> None:
        batch, aux, num_sampled, num_rejected, last_sampled = (args[0], args[4], args[5],
                                                               args[6], args[7])
        n, r = batch.num_tokens, batch.num_reqs
        self.steps.append({
            "req_ids": list(batch.req_ids),
            "input_ids": batch.input_ids[:n].cpu(), "positions": batch.positions[:n].cpu(),
            "query_start_loc": batch.query_start_loc[:r + 1].cpu(),
            "seq_lens": batch.seq_lens[:r].cpu(),
            "num_sampled": num_sampled[:r].cpu(), "num_rejected": num_rejected[:r].cpu(),
            "last_sampled": last_sampled[batch.idx_mapping[:r].long()].reshape(r, -1)[:, -1].cpu(),
            "aux": torch.cat([a[:n] for a in aux], -1).to(torch.bfloat16).cpu(),
            "drafts": drafts[:r].clone().cpu()})


def speculator_class(spec: dict):
    if spec["method"] == "eagle3":
        from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
        return EagleSpeculator
    from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
    return SpecplugV2HeadSpeculator


def record(args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams

    from vllm_specplug.cli.bench_inputs import load_prompts

    spec = json.loads(args.spec)
    recorder = Recorder()
    recorder.wrap(speculator_class(spec))
    llm = LLM(model=args.model, speculative_config=spec, max_model_len=4096, seed=0,
              gpu_memory_utilization=0.5, enable_prefix_caching=not args.no_prefix_caching)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    out, outputs = Path(args.out), []
    out.mkdir(parents=True, exist_ok=True)
    for p, prompt in enumerate(load_prompts("mt-bench", args.num_prompts)):
        request = prompt.input_for(tokenizer, 0)
        ids = (tokenizer(request)["input_ids"] if isinstance(request, str)
               else list(request["prompt_token_ids"]))
        recorder.steps.clear()
        result = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        outputs.append({"prompt_token_ids": ids,
                        "output_token_ids": list(result.outputs[0].token_ids),
                        "num_steps": len(recorder.steps)})
        save_file({f"{i:05d}.{field}": step[field].contiguous()
                   for i, step in enumerate(recorder.steps) for field in FIELDS},
                  str(out / f"{args.name}.{p}.safetensors"))
        print(f"{args.name} prompt {p}: {len(recorder.steps)} steps", flush=True)
    (out / f"{args.name}.json").write_text(json.dumps(
        {"spec": spec, "model": args.model, "prefix_caching": not args.no_prefix_caching,
         "outputs": outputs}, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("name")
    rec.add_argument("spec", help="a speculative_config as JSON")
    rec.add_argument("--model", required=True)
    rec.add_argument("--out", required=True)
    rec.add_argument("--num-prompts", type=int, default=4)
    rec.add_argument("--max-tokens", type=int, default=128)
    rec.add_argument("--no-prefix-caching", action="store_true")
    cmp = sub.add_parser("compare")
    cmp.add_argument("a")
    cmp.add_argument("b")
    cmp.add_argument("--dir", required=True)
    cmp.add_argument("--head", default=None)
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from benchmarks.gpu.record_compare import compare
        print(compare(Path(args.dir), args.a, args.b, args.head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
