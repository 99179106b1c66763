"""Decode capture sizes n * (K + 1) under a user's max_cudagraph_capture_size
(vllm#54933), on real VllmConfigs built by vLLM's EngineArgs.

The CPU platform captures no CUDA graphs, so each test switches the built
config to what CUDA would have (graphs on, the user's maximum, no explicit
sizes) and reruns vLLM's own `_set_cudagraph_sizes` (ours wraps it). The GPU
run checks the sizes an engine really captured (tests/gpu/).
"""
from __future__ import annotations

import pytest

from vllm_specplug.integration.cudagraph import decode_capture_sizes, request_counts

K = 5
QUERY_LEN = K + 1


def _sizes(tiny_model_dir, spec: dict | None, max_size: int | None,
           explicit: list[int] | None = None, max_num_seqs: int = 64) -> list[int]:
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(tiny_model_dir), speculative_config=spec,
                        max_model_len=512, max_num_seqs=max_num_seqs).create_engine_config()
    config.model_config.enforce_eager = False
    compilation = config.compilation_config
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    compilation.max_cudagraph_capture_size = max_size
    compilation.cudagraph_capture_sizes = explicit
    config._set_cudagraph_sizes()
    return list(compilation.cudagraph_capture_sizes)


def test_request_counts_follow_vllms_grid():
    assert request_counts(3) == [1, 2, 3]
    assert request_counts(20) == [1, 2, 4, 8, 16, 20]
    counts = request_counts(300)
    assert counts[-3:] == [272, 288, 300] and 248 in counts and 252 not in counts


def test_decode_sizes_are_multiples_under_the_maximum():
    assert decode_capture_sizes(1, 64, 512) == []
    assert decode_capture_sizes(6, 64, 5) == []
    assert decode_capture_sizes(6, 64, 100) == [6, 12, 24, 48, 96]


def test_our_method_keeps_decode_sizes_under_a_user_maximum(tiny_model_dir):
    spec = {"method": "specplug_ngram", "num_speculative_tokens": K}
    sizes = _sizes(tiny_model_dir, spec, max_size=96)
    assert sizes[-1] == 96                         # the user's maximum stays
    for n in (1, 2, 4, 8, 16):                     # every uniform decode step fits a graph
        assert n * QUERY_LEN in sizes, (n, sizes)
    plain = _sizes(tiny_model_dir, None, max_size=96)
    assert set(plain) <= set(sizes) and 6 not in plain   # what vLLM alone gives


def test_a_user_maximum_that_leaves_big_decode_steps_eager_is_warned_of(tiny_model_dir,
                                                                         caplog):
    """64 requests of 6 tokens are 384, over a maximum of 96: steps of more
    than 16 requests run without graphs, and the warning names the fix."""
    from vllm_specplug.integration.cudagraph import eager_decode_warning

    assert eager_decode_warning(1, 256, 8) is None           # no drafts: one token a request
    assert eager_decode_warning(QUERY_LEN, 16, 96) is None   # 16 x 6 = 96 fits
    spec = {"method": "specplug_ngram", "num_speculative_tokens": K}
    with caplog.at_level("WARNING"):
        _sizes(tiny_model_dir, spec, max_size=96)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "more than 16 requests (6 tokens each)" in said, said
    assert "max_cudagraph_capture_size to 384 (max_num_seqs 64)" in said, said
    for fits in (dict(spec=spec, max_size=384),   # 64 x 6 fits
                 dict(spec={**spec, "adaptive": True}, max_size=96)):  # sized per step
        caplog.clear()
        with caplog.at_level("WARNING"):
            _sizes(tiny_model_dir, **fits)
        assert "without CUDA graphs" not in caplog.text, fits


def test_vllm_defaults_and_explicit_sizes_are_left_alone(tiny_model_dir):
    spec = {"method": "specplug_ngram", "num_speculative_tokens": K}
    explicit = [1, 2, 4, 8]
    assert _sizes(tiny_model_dir, spec, max_size=None, explicit=explicit) == explicit
    default = _sizes(tiny_model_dir, spec, max_size=None)
    assert 64 * QUERY_LEN in default or default[-1] < 64 * QUERY_LEN
    assert all(n * QUERY_LEN in default for n in (1, 2, 4, 8))   # vLLM's own rule
    own = _sizes(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": K,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 5},
                 max_size=96)
    assert 6 not in own                            # vLLM's methods: vLLM's behaviour


@pytest.mark.parametrize("num_draft_tokens", [6, 12])  # 6 and 12 are off vLLM's grid
def test_tree_sizes_are_multiples_of_the_node_count(tiny_model_dir, tiny_eagle3_dir,
                                                    num_draft_tokens):
    spec = {"method": "specplug_eagle3", "model": str(tiny_eagle3_dir), "topk": 4,
            "num_steps": 4, "num_draft_tokens": num_draft_tokens}
    sizes = _sizes(tiny_model_dir, spec, max_size=128)
    for n in (1, 2, 4, 8):
        if n * num_draft_tokens <= 128:
            assert n * num_draft_tokens in sizes, (n, sizes)


def test_every_tree_decode_batch_gets_a_graph_by_default(tiny_model_dir, tiny_eagle3_dir):
    """vLLM's default keeps decode sizes under 512 tokens: a 16-node tree
    would verify eagerly from 33 requests on. Ours covers every request
    count of vLLM's grid up to max_num_seqs, and only adds sizes."""
    spec = {"method": "specplug_eagle3", "model": str(tiny_eagle3_dir), "topk": 4,
            "num_steps": 4, "num_draft_tokens": 16}
    sizes = _sizes(tiny_model_dir, spec, max_size=None, max_num_seqs=64)
    assert all(n * 16 in sizes for n in request_counts(64)), sizes
    assert sizes[-1] == 64 * 16
    plain = _sizes(tiny_model_dir, None, max_size=None, max_num_seqs=64)
    assert set(plain) <= set(sizes) and plain[-1] < 64 * 16


class _Manager:
    """What `CudaGraphManager._init_candidates` and `dispatch` read, from a
    real VllmConfig (the manager itself needs CUDA to be built)."""

    def __init__(self, config, query_len: int) -> None:
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

        self.vllm_config, self.compilation_config = config, config.compilation_config
        self.cudagraph_mode = config.compilation_config.cudagraph_mode
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.decode_query_len, self.varlen_decode = query_len, False
        self.lora_capture_cases, self.ubatch_runner = [0], None
        self._candidates, self._capture_descs = {}, {}
        self._lora_dispatch_map, self._max_lora_case = {}, 0
        self._graphs_captured = True
        for name in ("dispatch", "_resolve_effective_loras", "_maybe_ubatch_twin"):
            setattr(self, name, getattr(CudaGraphManager, name).__get__(self))


def test_sized_tree_decode_steps_find_a_full_graph_at_every_batch(tiny_model_dir,
                                                                  tiny_eagle3_dir):
    """A tree sized by batch (16 nodes up to 4 requests, 6 up to 24, 3
    beyond): vLLM captures FULL decode graphs for each query length, but
    dispatches a token count only to the next captured count's graphs, so
    5 requests of 6 tokens or 60 of 3 run PIECEWISE (the next graph is one
    of another query length). With our candidates every uniform decode
    batch of the table replays a FULL graph of its own query length."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specplug.patches.gpu_v2_cudagraph_utils import _init_candidates

    table = [[1, 4, 15], [5, 24, 5], [25, 1024, 2]]
    spec = {"method": "specplug_eagle3", "model": str(tiny_eagle3_dir), "topk": 4,
            "num_steps": 4, "num_draft_tokens": 16, "num_speculative_tokens_per_batch_size": table}
    config = EngineArgs(model=str(tiny_model_dir), speculative_config=spec, max_model_len=512,
                        max_num_seqs=64).create_engine_config()
    config.model_config.enforce_eager = False
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.max_cudagraph_capture_size = 1024
    config.compilation_config.cudagraph_capture_sizes = None
    config._set_cudagraph_sizes()
    tiers = [(n, 16 if n <= 4 else 6 if n <= 24 else 3) for n in range(1, 65)]

    def misses(manager) -> list[tuple[int, int]]:
        found = [(n, q, manager.dispatch(n, n * q, q, 0)) for n, q in tiers]
        return [(n, q) for n, q, desc in found
                if desc.cg_mode != CUDAGraphMode.FULL or desc.uniform_token_count != q]

    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    # vLLM's own, whether or not this process installed our patch already
    vllm_init = getattr(CudaGraphManager._init_candidates, "__wrapped__",
                        CudaGraphManager._init_candidates)
    vllms, ours = _Manager(config, query_len=16), _Manager(config, query_len=16)
    vllm_init(vllms)
    missed = misses(vllms)  # vLLM's own dispatch: 18 of the 64 batch sizes, in 0.32
    assert (5, 6) in missed and (60, 3) in missed and len(missed) >= 10, missed
    _init_candidates(vllm_init)(ours)
    assert misses(ours) == []


def test_compile_cache_keys_tell_our_methods_apart(tiny_model_dir, tiny_eagle3_dir):
    """vLLM keys its torch.compile cache by the config hash. All our methods
    reach it as `custom_class`, so without our factor an EAGLE-3 chain (the
    target returns auxiliary hidden states) and an n-gram (it does not) at
    the same K hashed alike, and one loaded the other's compiled graph."""
    from vllm.engine.arg_utils import EngineArgs

    def hashes(spec):
        config = EngineArgs(model=str(tiny_model_dir), speculative_config=spec,
                            max_model_len=512).create_engine_config()
        return config.speculative_config.compute_hash(), config.compute_hash()

    ngram = {"method": "specplug_ngram", "num_speculative_tokens": K}
    chain = {"method": "specplug_eagle3", "model": str(tiny_eagle3_dir), "topk": 1,
             "num_steps": K}
    spec_ngram, all_ngram = hashes(ngram)
    spec_chain, all_chain = hashes(chain)
    assert spec_ngram != spec_chain and all_ngram != all_chain
    assert hashes(dict(ngram)) == (spec_ngram, all_ngram)   # stable for the same spec
    # vLLM's own methods keep vLLM's hash
    from vllm_specplug.patches.registry import patch_registry

    (record,) = [r for r in patch_registry.applied()
                 if r.target.endswith("SpeculativeConfig.compute_hash")]
    suffix = EngineArgs(model=str(tiny_model_dir), max_model_len=512, speculative_config={
        "method": "suffix", "num_speculative_tokens": K}).create_engine_config()
    assert suffix.speculative_config.compute_hash() == record.original(suffix.speculative_config)
    chain_config, ngram_config = (
        EngineArgs(model=str(tiny_model_dir), speculative_config=spec,
                   max_model_len=512).create_engine_config().speculative_config
        for spec in (chain, ngram))
    assert record.original(chain_config) == record.original(ngram_config)  # vLLM's alone
