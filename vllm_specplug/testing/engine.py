"""Test-side engine helpers on top of the product's `vllm_specplug.engine`.

vLLM spawns processes: every script that calls `make_llm` needs an
`if __name__ == "__main__":` guard.
"""
from __future__ import annotations

from vllm_specplug.engine import (DEFAULT_KVCACHE_GIB, DEFAULT_MAX_MODEL_LEN,  # noqa: F401
                                  GenerationResult, generate, greedy_params, make_llm,
                                  running_llm, shutdown_llm)


def generate_each(llm, prompts: list[str], sampling_params) -> list[list[int]]:
    """Token ids of each prompt generated alone (a batch of one)."""
    return [generate(llm, [p], sampling_params).token_ids[0] for p in prompts]


def generate_with_abort(llm, prompts: list[str], sampling_params, abort_index: int,
                        abort_after_steps: int) -> dict[str, list[int]]:
    """Step the engine by hand and abort one request mid-generation.

    Returns the token ids each request produced, keyed "0", "1", ...; the
    aborted request's list is whatever it had produced before the abort.
    """
    engine = llm.llm_engine
    ids = [str(i) for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts):
        engine.add_request(req_id, prompt, sampling_params)
    produced: dict[str, list[int]] = {req_id: [] for req_id in ids}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            produced[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
        if steps == abort_after_steps:
            engine.abort_request([ids[abort_index]])
    return produced


def generate_in_phases(llm, prompts: list[str], sampling_params, phases, enter_phase):
    """Step the engine by hand through `phases`, [(number of steps or None
    for the rest, phase argument)], calling `enter_phase(argument)` as each
    begins. Returns the token ids per prompt and vLLM's speculative counts
    during each phase."""
    from vllm_specplug.metrics import read_spec_decode_counts

    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, sampling_params)
    produced: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    counts = []
    for num_steps, argument in phases:
        enter_phase(argument)
        before, steps = read_spec_decode_counts(llm), 0
        while engine.has_unfinished_requests() and (num_steps is None or steps < num_steps):
            for output in engine.step():
                produced[output.request_id] = list(output.outputs[0].token_ids)
            steps += 1
        counts.append(read_spec_decode_counts(llm) - before)
    return [produced[str(i)] for i in range(len(prompts))], counts
