"""vLLM CPU's expand kernel never writes non-int64 outputs, which corrupts
speculative verification whenever greedy and sampled requests share a batch;
our override (vllm_specplug/integration/v1/kernel_overrides.py) fixes it."""
from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from vllm_specplug.integration.v1.kernel_overrides import EXPAND_KERNEL, expand_kernel_impl
from vllm_specplug.metrics import read_spec_decode_counts
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
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    # vLLM's own choice of C++ library: `vllm._C` needs AVX-512 and dies with
    # SIGILL on an AVX2-only CPU, where the platform loads `vllm._C_AVX2`.
    current_platform.import_kernels()

    output = torch.full((3,), 123.0)
    cpu_triton_utils._expand_kernel_impl(output, torch.tensor([0.7, -1.0]),
                                         torch.tensor([2, 3]), -1, 1)
    assert output.tolist() == [123.0, 123.0, 123.0]


@pytest.fixture(scope="module")
def suffix_llm(tiny_model_dir, baseline_llm):
    """After the baseline engine: a new engine's Prometheus logger unregisters
    the process's vLLM metrics, so an engine made later would zero this one's
    speculation counters (`read_spec_decode_counts`)."""
    del baseline_llm
    # adaptive off: the distribution test needs verification to emit the
    # tokens under test, and 1200 requests at once is where the controller cuts
    llm = make_llm(tiny_model_dir, {"method": "specplug_suffix", "num_speculative_tokens": 4,
                                    "adaptive": False},
                   worker_extension_cls=PROBE_QUALNAME)
    yield llm
    shutdown_llm(llm)


def test_worker_routes_expand_to_our_override(suffix_llm):
    assert suffix_llm.collective_rpc("specplug_kernel_override", args=(EXPAND_KERNEL,)) == [
        "vllm_specplug.integration.v1.kernel_overrides.expand_kernel_impl"]


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


NUM_SAMPLES = 1200
REPEATING_PROMPT = "x = 1\ny = 2\nz = 3\nx = 1\ny = 2\nz = 3\nx = 1\ny = 2\n"
P_MIN = 1e-3


def sample_positions(llm, temperature: float, num_samples: int = NUM_SAMPLES
                     ) -> list[list[int]]:
    """`num_samples` seeded samples of 4 tokens after a prompt the proposers
    draft on; [position][sample] token ids."""
    params = [SamplingParams(temperature=temperature, max_tokens=4, seed=seed,
                             ignore_eos=True) for seed in range(num_samples)]
    outputs = llm.generate([REPEATING_PROMPT] * num_samples, params, use_tqdm=False)
    return [list(column) for column in zip(*(o.outputs[0].token_ids for o in outputs))]


def same_distribution_p(a: list[int], b: list[int]) -> float:
    """Chi-square test of homogeneity; tokens seen fewer than 10 times in
    both samples together are pooled into one category."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    total = Counter(a) + Counter(b)
    common = [t for t, n in total.items() if n >= 10]
    rows = [[Counter(s)[t] for t in common] + [sum(1 for x in s if x not in common)]
            for s in (a, b)]
    rows = [[row[i] for i in range(len(row)) if rows[0][i] + rows[1][i] > 0] for row in rows]
    return chi2_contingency(rows).pvalue if len(rows[0]) > 1 else 1.0


@pytest.fixture(scope="module")
def plain_samples(baseline_llm):
    return sample_positions(baseline_llm, 0.8)


def test_sampled_tokens_follow_the_target_distribution(suffix_llm, plain_samples):
    """Positions 1-3 are emitted by verification of drafts; at temperature
    0.8 they must follow the same distribution as without speculation."""
    before = read_spec_decode_counts(suffix_llm)
    speculative = sample_positions(suffix_llm, 0.8)
    counts = read_spec_decode_counts(suffix_llm) - before
    # Verification, not the target alone, emitted the tokens under test.
    assert counts.num_accepted_tokens > NUM_SAMPLES // 2, counts
    for position in (1, 2, 3):
        p = same_distribution_p(plain_samples[position], speculative[position])
        assert p > P_MIN, f"position {position}: p = {p:.2e}"


def test_the_distribution_check_catches_a_wrong_temperature(baseline_llm, plain_samples):
    """Power: samples at temperature 1.0 instead of 0.8 are told apart."""
    other = sample_positions(baseline_llm, 1.0)
    assert min(same_distribution_p(plain_samples[p], other[p]) for p in (1, 2, 3)) < P_MIN
