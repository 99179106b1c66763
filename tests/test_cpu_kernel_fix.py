"""vLLM CPU's expand kernel never writes non-int64 outputs, which corrupts
speculative verification whenever greedy and sampled requests share a batch;
our override (vllm_specplug/integration/kernel_overrides.py) fixes it."""
from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from vllm_specplug.integration.kernel_overrides import EXPAND_KERNEL, expand_kernel_impl
from vllm_specplug.testing.engine import greedy_params, make_llm, shutdown_llm
from vllm_specplug.testing.worker_probe import PROBE_QUALNAME

GREEDY_TEMPERATURE = -1.0


def reference_expand(values: list, counts: list[int], replace_from, replace_to) -> list:
    out = []
    for value, count in zip(values, counts):
        out += [replace_to if value == replace_from else value] * count
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("counts", [[1], [3, 0, 5, 1], [4] * 7, [0, 0, 2]])
def test_expand_matches_reference(dtype, counts):
    values = torch.tensor([GREEDY_TEMPERATURE if i % 2 else 0.5 + i for i in range(len(counts))])
    if not dtype.is_floating_point:
        values = torch.arange(len(counts)) * 3 - 1  # -1 = replace_from
    values = values.to(dtype)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    output = torch.full((sum(counts) + 2,), 99, dtype=dtype)  # 2 slots past the end
    expand_kernel_impl(output, values, cu, -1, 1)
    expected = reference_expand(values.tolist(), counts, -1, 1)
    assert output[:sum(counts)].tolist() == expected
    assert output[sum(counts):].tolist() == [99, 99]  # nothing written past num_tokens


def test_vllm_cpu_expand_leaves_float_output_unwritten():
    """The bug itself: if this fails, vLLM fixed it and the override can go."""
    import vllm._C  # noqa: F401 - loads the C++ ops
    from vllm.utils import cpu_triton_utils

    output = torch.full((3,), 123.0)
    cpu_triton_utils._expand_kernel_impl(output, torch.tensor([0.7, -1.0]),
                                         torch.tensor([2, 3]), -1, 1)
    assert output.tolist() == [123.0, 123.0, 123.0]


@pytest.fixture(scope="module")
def suffix_llm(tiny_model_dir):
    llm = make_llm(tiny_model_dir, {"method": "specplug_suffix", "num_speculative_tokens": 4},
                   worker_extension_cls=PROBE_QUALNAME)
    yield llm
    shutdown_llm(llm)


def test_worker_routes_expand_to_our_override(suffix_llm):
    assert suffix_llm.collective_rpc("specplug_kernel_override", args=(EXPAND_KERNEL,)) == [
        "vllm_specplug.integration.kernel_overrides.expand_kernel_impl"]


def test_greedy_requests_beside_sampled_ones_stay_exact(suffix_llm, baseline_llm,
                                                        eval_prompts):
    prompts = eval_prompts[:12]
    expected = [list(o.outputs[0].token_ids) for o in baseline_llm.generate(
        prompts, greedy_params(32), use_tqdm=False)]
    sampled = [SamplingParams(temperature=1.0, max_tokens=32, seed=7, n=2),
               SamplingParams(temperature=0.5, max_tokens=32),
               SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=32, seed=3),
               SamplingParams(temperature=0.8, max_tokens=32)]
    outputs = suffix_llm.generate(prompts + eval_prompts[12:16],
                                  [greedy_params(32)] * 12 + sampled, use_tqdm=False)
    greedy = [list(o.outputs[0].token_ids) for o in outputs[:12]]
    assert greedy == expected
