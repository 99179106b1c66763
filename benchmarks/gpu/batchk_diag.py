"""What the batch draft length chooses on the GPU (issue 27), step by step.

An in-process engine (the tiny model and its head as a 16-node tree with
`"adaptive": true`, Model Runner V2) generates at batch 1, 256, 64 and 1
again; after each `generate` it prints the scheduler's `BatchDraftLength`:
the length it runs, how often it chose each, the acceptance it expects per
length, the tokens/s it predicts per length at that batch, and the median
step times per (length, batch bucket). On the staged host (docs/gpu.md):

    export PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0
    python3 benchmarks/gpu/batchk_diag.py .gpu/work     # carry .gpu/work

docs/results/batch_draft_length_h100/diag_after.txt is its output.
"""
import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process

PHASES = ((1, 2), (256, 3), (64, 2), (1, 1))  # (batch size, generate calls)


def main(work: str) -> None:
    from vllm import LLM, SamplingParams

    prompts = [json.loads(line)["prompt"] for line in open(f"{work}/held_out.jsonl")]
    tree = {"method": "specplug_eagle3", "model": f"{work}/tiny-eagle3", "topk": 4,
            "num_steps": 4, "num_draft_tokens": 16, "draft_temperature": 0.25,
            "adaptive": True}
    llm = LLM(model=f"{work}/tiny", speculative_config=tree, dtype="float32", max_num_seqs=256,
              compilation_config={"max_cudagraph_capture_size": 1100}, seed=0)
    policy = llm.llm_engine.engine_core.engine_core.scheduler.draft_length
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for batch_size, calls in PHASES:
        for call in range(calls):
            started = time.perf_counter()
            if batch_size == 1:
                outputs = [o for p in prompts[:3] for o in llm.generate([p], params,
                                                                       use_tqdm=False)]
            else:
                outputs = llm.generate(prompts[:batch_size], params, use_tqdm=False)
            seconds = time.perf_counter() - started
            _report(policy, batch_size, call,
                    sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)


def _report(policy, batch_size: int, call: int, tokens_per_second: float) -> None:
    d = policy.as_dict()
    print(f"b={batch_size} rep={call} tok/s={tokens_per_second:.0f} current={d['current']} "
          f"chosen={d['chosen']} explored={d['num_explored']}/{d['num_steps']} "
          f"measured={d['num_measured']} stalled={d['num_stalled']} "
          f"first_at_shape={d['num_first_at_shape']} exp={d['expected_tokens_per_request']} "
          f"real={d['realised_tokens_per_request']}", flush=True)
    # what `choose` weighs at this batch size: b x E[tokens | K] / seconds(b, K)
    times = {k: policy.times.estimate(k, batch_size, policy.current) for k in policy.candidates}
    rates = {k: None if t is None else batch_size * policy.expected_tokens(k) / t[0]
             for k, t in times.items()}
    print("   rates", {k: None if r is None else round(r) for k, r in rates.items()},
          "E", {k: round(policy.expected_tokens(k), 2) for k in policy.candidates},
          "ms", d["step_ms"], flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
