"""What an EAGLE-3 speculator is handed and drafts, step by step, in a real
engine on Model Runner V2 (a diagnostic, for issue 26: our chain's τ fell
to 0.95x vLLM's `eagle3` with the same head on the H200, where driving our
speculator outside an engine, on the same GPU paths, drafts what the
reference drafts: docs/results/smollm2_sets_large_h200).

    record  NAME SPEC_JSON --model DIR --out DIR [--prompts mt-bench] [--num-prompts 4]
            [--turns 2] [--repeats 2] [--batch-size 1] [--max-tokens 128]
            [--max-num-seqs 64] [--max-model-len 2048] [--no-prefix-caching] [--no-hidden]
        One engine (in this process: vLLM's engine core and worker in-process,
        so the speculator's class can be wrapped), the conversations as
        `bench offline` runs them: greedy, to EOS or max_tokens, every
        prompt's first turn in waves of `--batch-size` requests, then the
        second turns, the whole set `--repeats` times (later passes on cached
        blocks). Every non-dummy `propose` call is recorded: the batch's
        request ids, its tokens and positions, query_start_loc, seq_lens,
        num_sampled, num_rejected, the last sampled token of each request,
        the target's auxiliary hidden states of every row (bfloat16, [num_tokens,
        L * H]; none with --no-hidden) and the drafts returned. NAME.json
        (the waves, each request's key rR.pP.tT and tokens) and
        NAME.rR.safetensors (a file a repeat: the device tool brings back 8
        files of at most 16 MiB).

    compare A B --dir DIR
        Two recordings of the same prompts (greedy, so the same outputs;
        benchmarks/gpu/record_compare.py): per request, each recording's τ at
        its own steps, how often the two drafted the same tokens, depth by
        depth, at the roots both drafted from, and the target's hidden states
        the two speculators were handed at the same verified positions (one
        target: they should agree to bf16 rounding); then τ by turn and by
        repeat.

Run on the staged GPU host (docs/gpu.md): `bash benchmarks/gpu/host.sh
record [ARGS]` records vLLM's `eagle3` K=5 and our chain K=5 with the same
head and prints the comparison; the files come back for a closer look.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from record_compare import FIELDS, compare  # beside this script


class Recorder:
    """Wraps a speculator class's `propose`: each real call's inputs and
    drafts copied to the host (a sync a step: speed is not measured here)."""

    def __init__(self, hidden: bool = True) -> None:
        self.steps: list[dict] = []
        self.hidden = hidden  # False: no hidden states kept (big batches' files)

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
            "aux": (torch.cat([a[:n] for a in aux], -1).to(torch.bfloat16).cpu()
                    if self.hidden else torch.zeros(n, 0, dtype=torch.bfloat16)),
            "drafts": drafts[:r].clone().cpu()})


def speculator_class(spec: dict):
    if spec["method"] == "eagle3":
        from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
        return EagleSpeculator
    from vllm_specplug.integration.v2.head_speculator import SpecplugV2HeadSpeculator
    return SpecplugV2HeadSpeculator


class Recording:
    """Waves (one `generate` call each: a batch of requests) and their
    recorded steps, saved as NAME.json and NAME.rR.safetensors
    (`record_compare.load` reads them)."""

    def __init__(self) -> None:
        self.waves: list[dict] = []
        self.tensors: dict[str, torch.Tensor] = {}

    def add_wave(self, key: str, requests: list[tuple[str, list[int], list[int]]],
                 steps: list[dict]) -> None:
        """`requests`: (its key rR.pP.tT, prompt ids, output ids) of each."""
        self.waves.append({"key": key, "req_ids": [step["req_ids"] for step in steps],
                           "requests": [{"key": k, "prompt_token_ids": list(prompt),
                                         "output_token_ids": list(output)}
                                        for k, prompt, output in requests]})
        self.tensors.update({f"{key}.{i:05d}.{field}": step[field].contiguous()
                             for i, step in enumerate(steps) for field in FIELDS})

    def save(self, out: Path, name: str, settings: dict) -> None:
        """NAME.json and a NAME.rR.safetensors a repeat: the device tool brings
        back 8 files of at most 16 MiB (4 conversations of 2 turns were
        about 8 MB a repeat with SmolLM2)."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        for repeat in sorted({key.split(".")[0] for key in self.tensors}):
            save_file({k: v for k, v in self.tensors.items() if k.startswith(f"{repeat}.")},
                      str(out / f"{name}.{repeat}.safetensors"))
        (out / f"{name}.json").write_text(json.dumps({**settings, "waves": self.waves},
                                                     indent=1) + "\n")


def _token_ids(request, tokenizer) -> list[int]:
    if isinstance(request, str):
        return tokenizer(request)["input_ids"]
    return list(request["prompt_token_ids"])


def record(args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process
    from vllm import LLM, SamplingParams

    from vllm_specplug.cli.bench_inputs import load_prompts

    spec = json.loads(args.spec)
    recorder = Recorder(hidden=not args.no_hidden)
    recorder.wrap(speculator_class(spec))
    # bench offline's engine: max_model_len 2048, max_num_seqs its largest batch
    # (the CUDA graphs' capture sizes follow it)
    llm = LLM(model=args.model, speculative_config=spec, max_model_len=args.max_model_len,
              seed=0, gpu_memory_utilization=0.5, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=not args.no_prefix_caching)
    tokenizer = llm.get_tokenizer()
    # as `bench offline` runs them: greedy, to EOS or max_tokens, turn after turn
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = load_prompts(args.prompts, args.num_prompts)
    recording = Recording()
    for repeat in range(args.repeats):  # a repeat finds the earlier one's blocks cached
        answers: list[list[str]] = [[] for _ in prompts]
        for turn in range(args.turns):  # every prompt's first turn, then the second ones
            active = [p for p, prompt in enumerate(prompts) if turn < prompt.num_turns]
            for w in range(0, len(active), args.batch_size):  # waves of batch_size
                wave = active[w:w + args.batch_size]
                ids = [_token_ids(prompts[p].input_for(tokenizer, turn, answers[p]), tokenizer)
                       for p in wave]
                recorder.steps.clear()
                outputs = llm.generate([{"prompt_token_ids": x} for x in ids], params,
                                       use_tqdm=False)
                for p, output in zip(wave, outputs):
                    answers[p].append(output.outputs[0].text)
                recording.add_wave(f"r{repeat}.t{turn}.w{w}",
                                   [(f"r{repeat}.p{p}.t{turn}", x, o.outputs[0].token_ids)
                                    for p, x, o in zip(wave, ids, outputs)], recorder.steps)
                print(f"{args.name} r{repeat} t{turn} wave {w}: {len(recorder.steps)} steps",
                      flush=True)
    recording.save(Path(args.out), args.name,
                   {"spec": spec, "model": args.model,
                    "prefix_caching": not args.no_prefix_caching})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("name")
    rec.add_argument("spec", help="a speculative_config as JSON")
    rec.add_argument("--model", required=True)
    rec.add_argument("--out", required=True)
    rec.add_argument("--prompts", default="mt-bench", help="a set as `bench offline` takes it")
    rec.add_argument("--num-prompts", type=int, default=4)
    rec.add_argument("--turns", type=int, default=2, help="turns of each conversation")
    rec.add_argument("--batch-size", type=int, default=1,
                     help="requests a `generate` call (a wave), as bench's batch size")
    rec.add_argument("--repeats", type=int, default=2,
                     help="passes over the prompts (the second on cached blocks)")
    rec.add_argument("--max-tokens", type=int, default=128)
    rec.add_argument("--max-num-seqs", type=int, default=64,
                     help="as bench offline's (its largest batch size)")
    rec.add_argument("--max-model-len", type=int, default=2048)
    rec.add_argument("--no-prefix-caching", action="store_true")
    rec.add_argument("--no-hidden", action="store_true",
                     help="keep no hidden states (files of big batches stay under 16 MiB)")
    cmp = sub.add_parser("compare")
    cmp.add_argument("a")
    cmp.add_argument("b")
    cmp.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args)
    else:
        print(compare(Path(args.dir), args.a, args.b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
