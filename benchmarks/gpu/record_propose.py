"""What an EAGLE-3 speculator is handed and drafts, step by step, in a real
engine on Model Runner V2 (a diagnostic, for issue 26: our chain's τ fell
to 0.95x vLLM's `eagle3` with the same head on the H200, where driving our
speculator outside an engine, on the same GPU paths, drafts what the
reference drafts: docs/results/smollm2_sets_large_h200).

    record  NAME SPEC_JSON --model DIR --out DIR [--prompts mt-bench] [--num-prompts 8]
            [--turns 2] [--repeats 2] [--batch-size 1] [--max-tokens 128]
            [--max-num-seqs 64] [--max-model-len 2048] [--engine-args JSON]
            [--no-prefix-caching] [--no-hidden] [--hidden-features 64] [--sync]
            [--in-process]
        One engine as `bench offline` starts it (its serving defaults, and by
        default the arguments v2_tree_runs.sh smollm2 adds; its core in a
        process of its own), the conversations as `bench offline` runs
        them: greedy, to EOS or max_tokens, every prompt's first turn in
        waves of `--batch-size` requests, then the second turns, the whole
        set `--repeats` times (later passes on cached blocks). In the
        engine's process (`RecordingWorker`, a worker extension) every
        non-dummy `propose` call of Model Runner V2's speculator is
        recorded: the batch's request ids, its tokens and positions,
        query_start_loc, seq_lens, num_sampled, num_rejected, the last
        sampled token of each request, the target's auxiliary hidden states
        of every row (bfloat16, [num_tokens, L * F], each layer's first F
        features; none with --no-hidden) and the drafts returned, cloned on
        the GPU without a sync and taken to the host after each wave.
        The recorder's first form (2026-12-04) ran the engine in this
        process (--in-process) and copied every step to the host at once
        (--sync): our chain's τ was vLLM's there, and 0.96x of it in
        `bench offline` the same day. NAME.json (the waves, each request's
        key rR.pP.tT and tokens) and NAME.rR.safetensors (a file a repeat:
        the device tool brings back 8 files of at most 16 MiB).

    compare A B --dir DIR
        Two recordings of the same prompts (greedy, so the same outputs;
        benchmarks/gpu/record_compare.py): per request, each recording's τ at
        its own steps, how often the two drafted the same tokens, depth by
        depth, at the roots both drafted from, and the target's hidden states
        the two speculators were handed at the same verified positions (one
        target: they should agree to bf16 rounding); then τ and per-position
        acceptance by turn and by repeat; then, over the requests with the
        same output, by the request's step (0: the one after its prefill),
        the common roots, those drafting the same first token and another
        second one, and the drafts each accepted there.

Run on the staged GPU host (docs/gpu.md): `bash benchmarks/gpu/host.sh
record [ARGS]` records vLLM's `eagle3` K=5 and our chain K=5 with the same
head and prints the comparison (`RECORD_ONLY=ours`: our chain again, beside
vLLM's recording of an earlier call); the files come back for a closer look.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from record_compare import FIELDS, compare  # beside this script

from vllm_specplug.bench.worker_info import WorkerInfo

# what benchmarks/gpu/v2_tree_runs.sh smollm2 passes `bench offline` (--engine-args)
BENCH_ENGINE_ARGS = '{"compilation_config": {"max_cudagraph_capture_size": 1024}}'


class Recorder:
    """Wraps a speculator's `propose`: each real call's inputs and drafts
    cloned on their device (no synchronisation: the host runs ahead of the
    GPU as in `bench offline`, where the per-step copies to the host of the
    recorder's first form ran every step behind a sync), taken to the host
    after each wave (`take`). `sync`: copied to the host at once."""

    def __init__(self, hidden: bool = True, sync: bool = False,
                 hidden_features: int | None = None) -> None:
        self.steps: list[dict] = []
        self.hidden = hidden  # False: no hidden states kept (big batches' files)
        self.sync = sync
        # each layer's first features only (None: all): enough to tell two
        # targets' rows apart, and 8 conversations' files stay under 16 MiB
        self.hidden_features = hidden_features

    def wrap(self, speculator) -> None:
        """Record `speculator.propose`'s calls from now on (Model Runner V2's
        arguments; dummy runs left out)."""
        original = speculator.propose

        def propose(*args, **kwargs):
            drafts = original(*args, **kwargs)
            if args and not kwargs.get("dummy_run", False):
                self.record(args, drafts)
            return drafts

        speculator.propose = propose

    def record(self, args, drafts: torch.Tensor) -> None:
        batch, aux, num_sampled, num_rejected, last_sampled = (args[0], args[4], args[5],
                                                               args[6], args[7])
        n, r = batch.num_tokens, batch.num_reqs
        keep = (lambda t: t.cpu()) if self.sync else (lambda t: t.clone())
        self.steps.append({
            "req_ids": list(batch.req_ids),
            "input_ids": keep(batch.input_ids[:n]), "positions": keep(batch.positions[:n]),
            "query_start_loc": keep(batch.query_start_loc[:r + 1]),
            "seq_lens": keep(batch.seq_lens[:r]),
            "num_sampled": keep(num_sampled[:r]), "num_rejected": keep(num_rejected[:r]),
            "last_sampled": keep(last_sampled[batch.idx_mapping[:r].long()].reshape(r, -1)[:, -1]),
            "aux": (keep(torch.cat([a[:n, :self.hidden_features] for a in aux], -1)
                         .to(torch.bfloat16))
                    if self.hidden else torch.zeros(n, 0, dtype=torch.bfloat16)),
            "drafts": keep(drafts[:r])})

    def take(self) -> list[dict]:
        """The steps recorded since the last call, on the host."""
        steps = [{k: v if k == "req_ids" else v.cpu() for k, v in step.items()}
                 for step in self.steps]
        self.steps.clear()
        return steps


class WaveTensors:
    """The recorded steps' tensors by wave, saved as NAME.rR.safetensors (a
    file a repeat: the device tool brings back 8 files of at most 16 MiB;
    4 conversations of 2 turns were about 8 MB a repeat with SmolLM2 and
    every feature of the hidden states, 8 take about 4 MB with each layer's
    first 64)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, key: str, steps: list[dict]) -> list[list[str]]:
        """Wave `key`'s steps; returns each step's request ids."""
        self.tensors.update({f"{key}.{i:05d}.{field}": step[field].contiguous()
                             for i, step in enumerate(steps) for field in FIELDS})
        return [step["req_ids"] for step in steps]

    def save(self, out: Path, name: str) -> None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        for repeat in sorted({key.split(".")[0] for key in self.tensors}):
            save_file({k: v for k, v in self.tensors.items() if k.startswith(f"{repeat}.")},
                      str(out / f"{name}.{repeat}.safetensors"))


class RecordingWorker(WorkerInfo):
    """A worker extension (`LLM(worker_extension_cls="record_propose.RecordingWorker")`,
    this directory on PYTHONPATH): the recorder runs in the engine's own
    process, so the engine runs as `bench offline`'s does (its core in a
    process of its own, the host running ahead of the GPU)."""

    specplug_recorder: Recorder | None = None  # until specplug_record_start wraps one
    specplug_waves: WaveTensors | None = None

    def specplug_record_start(self, hidden: bool, sync: bool,
                              hidden_features: int | None) -> str | None:
        """Wraps Model Runner V2's speculator; its class name (None where the
        runner has none: the V1 runner on CPU, nothing recorded)."""
        speculator = getattr(self.model_runner, "speculator", None)
        if speculator is None:
            return None
        self.specplug_recorder = Recorder(hidden, sync, hidden_features)
        self.specplug_recorder.wrap(speculator)
        self.specplug_waves = WaveTensors()
        return type(speculator).__name__

    def specplug_record_take(self, key: str) -> list[list[str]]:
        """The steps since the last call, kept as wave `key`; their request ids."""
        if self.specplug_recorder is None:
            return []
        return self.specplug_waves.add(key, self.specplug_recorder.take())

    def specplug_record_save(self, out: str, name: str) -> None:
        if self.specplug_waves is not None:
            self.specplug_waves.save(Path(out), name)


class Recording:
    """Waves (one `generate` call each: a batch of requests) and their steps'
    request ids, saved as NAME.json beside the worker's NAME.rR.safetensors
    (`record_compare.load` reads them)."""

    def __init__(self) -> None:
        self.waves: list[dict] = []

    def add_wave(self, key: str, requests: list[tuple[str, list[int], list[int]]],
                 req_ids: list[list[str]]) -> None:
        """`requests`: (its key rR.pP.tT, prompt ids, output ids) of each;
        `req_ids`: each recorded step's request ids."""
        self.waves.append({"key": key, "req_ids": req_ids,
                           "requests": [{"key": k, "prompt_token_ids": list(prompt),
                                         "output_token_ids": list(output)}
                                        for k, prompt, output in requests]})

    def save(self, out: Path, name: str, settings: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps({**settings, "waves": self.waves},
                                                     indent=1) + "\n")


def _token_ids(request, tokenizer) -> list[int]:
    if isinstance(request, str):
        return tokenizer(request)["input_ids"]
    return list(request["prompt_token_ids"])


def _engine(args, spec: dict):
    """`bench offline`'s engine (its serving defaults, max_model_len 2048,
    max_num_seqs its largest batch: the CUDA graphs' capture sizes follow
    it, and the arguments v2_tree_runs.sh adds: --engine-args), with the
    recording worker extension; its core in a process of its own unless
    --in-process."""
    from vllm import LLM

    from vllm_specplug.bench.offline import serving_defaults

    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    here = str(Path(__file__).resolve().parent)  # the engine's process imports this module
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH")) if p)
    options = serving_defaults({"max_model_len": args.max_model_len,
                                "max_num_seqs": args.max_num_seqs,
                                "gpu_memory_utilization": 0.5,
                                "enable_prefix_caching": not args.no_prefix_caching,
                                **json.loads(args.engine_args)})
    options["worker_extension_cls"] = "record_propose.RecordingWorker"
    llm = LLM(model=args.model, speculative_config=spec, seed=0, **options)
    found = llm.collective_rpc("specplug_record_start", args=(
        not args.no_hidden, args.sync, args.hidden_features or None))[0]
    print(f"{args.name}: recording {found or 'nothing (no Model Runner V2 speculator)'}",
          flush=True)
    return llm


def record(args) -> None:
    from vllm import SamplingParams

    from vllm_specplug.cli.bench_inputs import load_prompts

    spec = json.loads(args.spec)
    llm = _engine(args, spec)
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
                wave, key = active[w:w + args.batch_size], f"r{repeat}.t{turn}.w{w}"
                ids = [_token_ids(prompts[p].input_for(tokenizer, turn, answers[p]), tokenizer)
                       for p in wave]
                outputs = llm.generate([{"prompt_token_ids": x} for x in ids], params,
                                       use_tqdm=False)
                # the wave's steps to the host in the worker, after the wave
                req_ids = llm.collective_rpc("specplug_record_take", args=(key,))[0]
                for p, output in zip(wave, outputs):
                    answers[p].append(output.outputs[0].text)
                recording.add_wave(key, [(f"r{repeat}.p{p}.t{turn}", x, o.outputs[0].token_ids)
                                         for p, x, o in zip(wave, ids, outputs)], req_ids)
                print(f"{args.name} r{repeat} t{turn} wave {w}: {len(req_ids)} steps", flush=True)
    llm.collective_rpc("specplug_record_save", args=(str(Path(args.out).resolve()), args.name))
    recording.save(Path(args.out), args.name,
                   {"spec": spec, "model": args.model,
                    "prefix_caching": not args.no_prefix_caching,
                    "engine_args": json.loads(args.engine_args), "sync": args.sync,
                    "in_process": args.in_process})


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
    rec.add_argument("--num-prompts", type=int, default=8,
                     help="bench's batch-1 rows run 8 (--limit-prompts 1=8)")
    rec.add_argument("--turns", type=int, default=2, help="turns of each conversation")
    rec.add_argument("--batch-size", type=int, default=1,
                     help="requests a `generate` call (a wave), as bench's batch size")
    rec.add_argument("--repeats", type=int, default=2,
                     help="passes over the prompts (the second on cached blocks)")
    rec.add_argument("--max-tokens", type=int, default=128)
    rec.add_argument("--max-num-seqs", type=int, default=64,
                     help="as bench offline's (its largest batch size)")
    rec.add_argument("--max-model-len", type=int, default=2048)
    rec.add_argument("--engine-args", default=BENCH_ENGINE_ARGS,
                     help="vllm.LLM arguments as JSON (default: v2_tree_runs.sh smollm2's)")
    rec.add_argument("--hidden-features", type=int, default=64,
                     help="features kept of each layer's hidden states (0: all)")
    rec.add_argument("--in-process", action="store_true",
                     help="the engine's core in this process (the recorder's first form)")
    rec.add_argument("--sync", action="store_true",
                     help="copy each step to the host at once (a sync a step)")
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
