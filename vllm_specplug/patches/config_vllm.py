"""Patches of `vllm.config.vllm.VllmConfig`: `_get_v2_model_runner_unsupported_features`,
`__post_init__` and `_set_cudagraph_sizes`.

`__post_init__` also settles the CPU platform's thread binding of a sharded
target on a machine with fewer NUMA nodes than ranks, before any worker
starts (integration/cpu_threads.py): vLLM has no hook there either.

Why: our methods reach vLLM as `method="custom_class"`, which vLLM sends to
the V1 model runner and runs without async scheduling. On CUDA our model-free
proposers run under Model Runner V2 (`integration/v2/speculator.py`), with
async scheduling (vLLM's `AsyncScheduler` by default; `SpecplugAsyncScheduler`,
whose placeholders follow each request's draft length, on request). Both decisions are made inside VllmConfig with
no hook: here they are made for our selection only, and only on CUDA with
Model Runner V2; every other config is untouched. A user's explicit
`async_scheduling=False`, `scheduler_cls` or `VLLM_USE_V2_MODEL_RUNNER=0`
is kept.

`_set_cudagraph_sizes`: with a user's `max_cudagraph_capture_size` vLLM drops
the n * (K + 1) decode sizes it adds otherwise (vllm#54933), so speculative
decode steps of our methods would run eagerly; we add them back
(integration/cudagraph.py). Without one, vLLM adds decode sizes only under
512 tokens, which a 16-node tree passes at 33 requests; we add them up to
max_num_seqs requests (within max_num_batched_tokens). Explicit
`cudagraph_capture_sizes` are kept as given.
"""
from __future__ import annotations

import logging

from vllm_specplug.patches.registry import patch_registry

logger = logging.getLogger("vllm_specplug.config")

CUSTOM_CLASS_ENTRY = "speculative method 'custom_class'"
NOT_OURS = object()


def _v2_capable_selection(config):
    """Our selection when its proposer runs under Model Runner V2 on this
    platform (CUDA), else None."""
    from vllm.platforms import current_platform

    from vllm_specplug.integration.config import selection_of
    from vllm_specplug.registry import get_proposer_class

    spec = getattr(config, "speculative_config", None)
    selection = selection_of(spec) if spec is not None else None
    if selection is None or not current_platform.is_cuda():
        return None
    return selection if get_proposer_class(selection.method).runs_on_model_runner_v2 \
        else None


def _unsupported_features(original):
    def unsupported(self):
        features = original(self)
        if _v2_capable_selection(self) is not None:
            features = [f for f in features if f != CUSTOM_CLASS_ENTRY]
        return features

    return unsupported


def _post_init(original):
    def post_init(self):
        wanted = NOT_OURS
        if _v2_capable_selection(self) is not None:
            # vLLM refuses custom_class with async scheduling, and unset it
            # warns that async is "not supported" before turning it off: off
            # through its post-init, which then runs as for an explicit False
            # (the state it leaves is the same), and we decide below
            wanted = self.scheduler_config.async_scheduling
            self.scheduler_config.async_scheduling = False
        original(self)
        if wanted is not NOT_OURS:
            _decide_async(self, wanted)
        _grammar_tree_scheduler(self)
        _batch_draft_schedule(self)
        _cpu_thread_binding(self)
        _tree_budget_placement(self)

    return post_init


def _batch_draft_schedule(config) -> None:
    """One draft length (or tree size) per step for the whole batch
    (integration/batch_schedule.py): our scheduler stands in for vLLM's
    dynamic table. Under async scheduling on Model Runner V2 with `adaptive`
    true (or "batch"), where the table set here makes vLLM capture a
    FULL-graph family per candidate length; on the sync path (vLLM's V1
    runner) with `adaptive: "batch"`. A user's scheduler or data parallelism
    (vLLM turns tables off there) keeps it off; a user's table too, unless
    `adaptive` asks (then its lengths are the candidates)."""
    from vllm_specplug.integration import batch_schedule
    from vllm_specplug.integration.config import (BATCH_MODE, batch_draft_length_wanted,
                                                  selection_of)

    spec = getattr(config, "speculative_config", None)
    selection = selection_of(spec) if spec is not None else None
    scheduler = config.scheduler_config
    if selection is None or config.parallel_config.data_parallel_size > 1:
        return
    on_v2 = (_v2_capable_selection(config) is not None and config.use_v2_model_runner
             and scheduler.async_scheduling)
    if not (batch_draft_length_wanted(selection) if on_v2 else selection.adaptive == BATCH_MODE):
        return
    tree = scheduler.scheduler_cls in (TREE_ASYNC_SCHEDULER, TREE_SCHEDULER)
    if scheduler.scheduler_cls and not tree:
        logger.info("vllm-specplug: scheduler_cls %s kept; no per-step draft length",
                    scheduler.scheduler_cls)
        return
    if spec.num_speculative_tokens_per_batch_size is not None and selection.adaptive == "auto":
        return  # the user's static table, as given
    if on_v2 and spec.num_speculative_tokens_per_batch_size is None:
        candidates = batch_schedule.draft_length_candidates(spec.num_speculative_tokens)
        spec.num_speculative_tokens_per_batch_size = batch_schedule.capture_table(
            candidates, scheduler.max_num_seqs)
    name = "SpecplugBatchDraft" + ("Tree" if tree else "") + (
        "AsyncScheduler" if scheduler.async_scheduling else "Scheduler")
    scheduler.scheduler_cls = f"{batch_schedule.__name__}.{name}"
    logger.info("vllm-specplug %s: one draft length per step (%s)", selection.method, name)


def _tree_budget_placement(config) -> None:
    """Our tree budget where it runs, or an error naming the fix before any
    worker starts (integration/config.check_tree_budget_placement)."""
    from vllm_specplug.integration.config import check_tree_budget_placement, selection_of

    spec = getattr(config, "speculative_config", None)
    selection = selection_of(spec) if spec is not None else None
    if selection is None:
        return
    parallel = config.parallel_config
    check_tree_budget_placement(
        selection, parallel.pipeline_parallel_size,
        _v2_capable_selection(config) is not None
        and bool(getattr(config, "use_v2_model_runner", False))
        and not _batch_draft_scheduled(config))


def _batch_draft_scheduled(config) -> bool:
    from vllm_specplug.integration.batch_schedule import batch_draft_scheduled

    return batch_draft_scheduled(config)


def _cpu_thread_binding(config) -> None:
    """On vLLM's CPU platform, a sharded target on fewer NUMA nodes than
    ranks gets its CPUs split between ranks where the user set no binding,
    or an error naming the fix (integration/cpu_threads.py). Any config:
    vLLM would stop on it otherwise. A binding we set for an earlier engine
    of this process counts as unset (`OURS` remembers it), so the next
    engine, sharded otherwise or not at all, is not given it."""
    import os

    from vllm.platforms import current_platform

    from vllm_specplug.integration.cpu_threads import ENV, OURS, thread_binding

    if not current_platform.is_cpu():
        return
    current = os.environ.get(ENV)
    if current is not None and current == os.environ.get(OURS):
        current = None
        os.environ.pop(ENV)
        os.environ.pop(OURS)
    parallel = config.parallel_config
    num_ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    if num_ranks <= 1:
        return
    import vllm.utils.cpu_resource_utils as cpu_resources

    num_nodes = len(cpu_resources.get_visible_memory_node())
    value = thread_binding(num_ranks, sorted(os.sched_getaffinity(0)), num_nodes, current)
    if value is not None:
        os.environ[ENV] = os.environ[OURS] = value
        logger.warning("vllm-specplug: %d CPU ranks on %d NUMA node(s): %s=%r (one CPU list "
                       "per rank; set it yourself to choose others)", num_ranks, num_nodes,
                       ENV, value)


TREE_SCHEDULER = "vllm_specplug.integration.scheduler.SpecplugTreeScheduler"
TREE_ASYNC_SCHEDULER = "vllm_specplug.integration.scheduler.SpecplugTreeAsyncScheduler"


def _grammar_tree_scheduler(config) -> None:
    """Our tree methods get a scheduler that checks grammars per tree node
    (integration/grammar_trees.py), unless the user named one:
    `SpecplugTreeScheduler` on the sync path (the V1 runner),
    `SpecplugTreeAsyncScheduler` under async scheduling (Model Runner V2)."""
    from vllm_specplug.integration.config import selection_of
    from vllm_specplug.proposers.eagle3 import TreeProposer
    from vllm_specplug.registry import get_proposer_class

    spec = getattr(config, "speculative_config", None)
    selection = selection_of(spec) if spec is not None else None
    scheduler = config.scheduler_config
    if (selection is None or scheduler.scheduler_cls
            or not issubclass(get_proposer_class(selection.method), TreeProposer)):
        return
    scheduler.scheduler_cls = TREE_ASYNC_SCHEDULER if scheduler.async_scheduling \
        else TREE_SCHEDULER


def _decide_async(config, wanted) -> None:
    scheduler = config.scheduler_config
    method = _v2_capable_selection(config).method
    if wanted is False or not config.use_v2_model_runner:
        if wanted:
            raise ValueError(
                f"speculative_config method {method!r}: async_scheduling=True needs "
                "Model Runner V2 (unset VLLM_USE_V2_MODEL_RUNNER=0, or drop "
                "async_scheduling)")
        return
    # vLLM's AsyncScheduler (K slots per request) unless the user names one:
    # on the H100, uniform K-slot steps replay FULL CUDA graphs, and were 1.9x
    # faster at batch 1 than SpecplugAsyncScheduler's variable-length steps,
    # which mostly replay PIECEWISE ones (docs/results/model_runner_v2_h100.txt).
    scheduler.async_scheduling = True
    logger.info("vllm-specplug %s: Model Runner V2 with async scheduling (%s)", method,
                scheduler.scheduler_cls or "AsyncScheduler")


def _set_cudagraph_sizes(original):
    def set_cudagraph_sizes(self):
        from vllm_specplug.integration.config import selection_of

        compilation = self.compilation_config
        given = (compilation.max_cudagraph_capture_size, compilation.cudagraph_capture_sizes)
        original(self)
        if given[1] is not None or selection_of(self.speculative_config) is None:
            return
        sizes = list(compilation.cudagraph_capture_sizes or [])
        wanted = _decode_sizes(self, sizes, user_max=given[0])
        if wanted != sizes:
            compilation.cudagraph_capture_sizes = wanted
            compilation.max_cudagraph_capture_size = wanted[-1]
            logger.info("vllm-specplug: added %d decode capture sizes (multiples of %d), "
                        "up to %d tokens", len(wanted) - len(sizes),
                        self.uniform_decode_query_len, wanted[-1])

    return set_cudagraph_sizes


def _decode_sizes(config, sizes: list[int], user_max: int | None) -> list[int]:
    """Under a user's maximum: the decode sizes under it, and a warning where
    decode steps of max_num_seqs requests pass it (unless the drafts are
    sized per batch, by a table or by our per-step policy, whose table is set
    after this: their smaller lengths may fit). Otherwise: every decode size
    up to max_num_seqs requests, within max_num_batched_tokens."""
    from vllm_specplug.integration.config import batch_draft_length_wanted, selection_of
    from vllm_specplug.integration.cudagraph import (eager_decode_warning, with_all_decode_sizes,
                                                     with_decode_sizes)

    scheduler = config.scheduler_config
    if user_max is not None:
        spec = config.speculative_config
        sized = (getattr(spec, "num_speculative_tokens_per_batch_size", None)
                 or batch_draft_length_wanted(selection_of(spec)))
        # no sizes: no graphs at all (the CPU, enforce_eager)
        warning = None if sized or not sizes else eager_decode_warning(
            config.uniform_decode_query_len, scheduler.max_num_seqs, user_max)
        if warning:
            logger.warning(warning)
        return with_decode_sizes(sizes, config.uniform_decode_query_len, scheduler.max_num_seqs)
    return with_all_decode_sizes(sizes, config.uniform_decode_query_len,
                                 scheduler.max_num_seqs, scheduler.max_num_batched_tokens)


def install() -> list[str]:
    from vllm.config.vllm import VllmConfig

    patch_registry.apply(VllmConfig, "_get_v2_model_runner_unsupported_features",
                         _unsupported_features(
                             VllmConfig._get_v2_model_runner_unsupported_features),
                         reason="run vllm-specplug proposers under Model Runner V2 on CUDA")
    patch_registry.apply(VllmConfig, "__post_init__", _post_init(VllmConfig.__post_init__),
                         reason="async scheduling for vllm-specplug proposers on Model "
                                "Runner V2")
    patch_registry.apply(VllmConfig, "_set_cudagraph_sizes",
                         _set_cudagraph_sizes(VllmConfig._set_cudagraph_sizes),
                         reason="decode capture sizes n*(K+1) for every decode batch "
                                "(vllm#54933; trees pass vLLM's 512-token default)")
    return ["patch:VllmConfig._get_v2_model_runner_unsupported_features",
            "patch:VllmConfig.__post_init__", "patch:VllmConfig._set_cudagraph_sizes"]
