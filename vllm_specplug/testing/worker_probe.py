"""A worker extension that reports, from inside a worker process, whether our
plugin registered there.

Use with `LLM(..., worker_extension_cls=PROBE_QUALNAME)` and
`llm.collective_rpc("specplug_registration_state")`. vLLM only logs a plugin's
exception, so this is how a test can fail when `register()` breaks.
"""
from __future__ import annotations

from collections import Counter

from vllm_specplug.bench.worker_info import graph_captures, prefix_stats, runner_state

PROBE_QUALNAME = "vllm_specplug.testing.worker_probe.SpecplugProbe"


class SpecplugProbe:
    """Everything the tests ask a worker (a superset of the bench's WorkerInfo)."""

    def specplug_runner_state(self) -> dict:
        return runner_state(self)

    def specplug_record_cudagraph_modes(self) -> None:
        """From now on, count the CUDA-graph mode of every step this worker
        runs (needs the engine's `cudagraph_metrics=True`)."""
        record_cudagraph_modes(self.model_runner)

    def specplug_cudagraph_modes(self) -> list[dict]:
        """[{num_tokens, num_padded_tokens, mode, count}], most frequent first."""
        counts = getattr(self.model_runner, "_specplug_cudagraph_counts", Counter())
        return [{"num_tokens": t, "num_padded_tokens": p, "mode": m, "count": c}
                for (t, p, m), c in counts.most_common()]

    def specplug_watch_syncs(self) -> None:
        """From now on, log where this worker's steps make the host wait for
        the GPU (testing/host_syncs.py; CUDA only)."""
        from vllm_specplug.testing.host_syncs import watch_syncs

        watch_syncs(self.model_runner)

    def specplug_syncs(self) -> dict:
        """The log since `specplug_watch_syncs`: steps and syncs by kind, by
        call site, and those of our package (`SyncLog.report`)."""
        return self.model_runner._specplug_sync_log.report()

    def specplug_speculator_stats(self) -> dict | None:
        """Steps, host seconds in propose, draft tokens and slots of our Model
        Runner V2 speculator (None for any other)."""
        stats = getattr(getattr(self.model_runner, "speculator", None), "stats", None)
        return None if stats is None else stats.as_dict()

    def specplug_grammar_choice_counts(self) -> list[int] | None:
        """`grammar_verify: "choices"`: [requests decided so, nodes decided
        from their top-k, nodes from their full row] (integration/
        grammar_choices.py), on either runner; None when off."""
        runner = self.model_runner
        v1 = getattr(getattr(runner, "drafter", None), "tree_choices", None)
        choices = (v1.choices if v1 is not None else
                   getattr(getattr(runner, "speculator", None), "grammar_choices", None))
        return None if choices is None else choices.counts.tolist()

    def specplug_graph_captures(self) -> dict | None:
        """The head's graphs captured in service (`PassGraphs.service_captures`)."""
        return graph_captures(self)

    def specplug_adaptive_verification_state(self) -> dict:
        """vLLM's adaptive verification as the runner runs it: whether it
        made the manager, and how far our speculator's acceptance estimator
        got (state slots with draft-step features, refits)."""
        runner = self.model_runner
        estimator = getattr(getattr(runner, "speculator", None), "acceptance_estimator", None)
        return {"manager": getattr(runner, "adaptive_verification", None) is not None,
                "estimator": estimator is not None,
                "slots_with_features": 0 if estimator is None else
                int(estimator.features.ne(0).any(1).sum()),
                "refits": 0 if estimator is None else estimator._refits}

    def specplug_head_pool_state(self) -> dict | None:
        """Our Model Runner V2 head speculator's cache pool: slots, capacity
        and reallocations; its fused decode-step graphs: how many, their keys,
        and the target layouts (width, dtype) they were captured for (None
        without that speculator)."""
        speculator = getattr(self.model_runner, "speculator", None)
        pool = getattr(getattr(speculator, "runtime", None), "pool", None)
        if pool is None:
            return None
        steps = speculator.runtime.graphs.keys("step") if speculator.runtime.graphs else []
        return {"num_slots": pool.num_slots, "capacity": pool.capacity,
                "version": pool.version, "max_positions": speculator.max_positions,
                "max_num_reqs": speculator.max_num_reqs, "step_graphs": len(steps),
                "step_layouts": sorted({(key[-2], str(key[-1])) for key in steps}),
                # (padded batch, rows per request, key range, tree shape) of each
                "step_keys": sorted((key[1], key[2], key[3], tuple(key[4])) for key in steps)}

    def specplug_prefix_stats(self) -> dict | None:
        return prefix_stats(self)

    def specplug_adaptive_stats(self) -> dict | None:
        from vllm_specplug.bench.worker_info import adaptive_stats

        return adaptive_stats(self)

    def specplug_adaptive_pin(self, fixed_ms: float | None, per_token_ms: float = 0.0,
                              only_rank: int | None = None) -> None:
        """Pin the adaptive controller's step-cost line (None: back to the
        measured fit), so a test can make speculation pay or not; the tree
        budget's line for steps without drafts is pinned to the same one.
        `only_rank`: on that tensor-parallel rank only (ranks that disagree)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from vllm_specplug.bench.worker_info import adaptive_controller

        if only_rank is not None and get_tensor_model_parallel_rank() != only_rank:
            return
        controller = adaptive_controller(self)
        pinned = None if fixed_ms is None else (fixed_ms / 1e3, per_token_ms / 1e3)
        for line in (controller.cost, getattr(controller, "plain_cost", None)):
            if line is not None:
                line.pinned = pinned

    def specplug_tree_profile(self, enable: bool | None = None) -> list[dict]:
        """Per-step phase times of tree steps so far (cleared); `enable`
        turns the profiler on or off (integration/v1/tree_profile.py)."""
        from vllm_specplug.integration.v1.tree_profile import PROFILER

        taken = PROFILER.take()
        if enable is not None:
            PROFILER.enable(enable)
        return taken

    def specplug_torch_profile(self, start: bool, row_limit: int = 30) -> dict | None:
        """Benchmarks: start torch's profiler in this worker (CPU + CUDA), or
        stop it and return its kernel table: {"table": text sorted by self
        device time, "events": [{name, count, self_device_us, self_cpu_us}]}."""
        import torch

        if start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._specplug_profiler = torch.profiler.profile(activities=activities)
            self._specplug_profiler.__enter__()
            return None
        profiler = self._specplug_profiler
        profiler.__exit__(None, None, None)
        averages = profiler.key_averages()
        device = lambda e: getattr(e, "self_device_time_total", 0.0)  # noqa: E731
        events = sorted(averages, key=device, reverse=True)[:row_limit]
        return {"table": averages.table(sort_by="self_device_time_total", row_limit=row_limit),
                "events": [{"name": e.key, "count": e.count, "self_device_us": device(e),
                            "self_cpu_us": e.self_cpu_time_total} for e in events]}

    def specplug_tree_draft_shape(self, num_nodes: int | None, chain: bool = False) -> str:
        """Verify only the first `num_nodes` drafted nodes, as a tree or chain."""
        drafter = self.model_runner.drafter
        drafter.set_draft_shape(num_nodes, chain)
        return f"{type(drafter).__name__}: {drafter.draft_shape}"

    def specplug_tree_attention_state(self) -> dict:
        """Whether CUDA tree attention is active in this worker, the attention
        backend of the first layer, and the trees it has seen (masked steps)."""
        from vllm_specplug.integration import cuda_tree_attention

        layers = self.model_runner.vllm_config.compilation_config.static_forward_context
        buffers = cuda_tree_attention.attached(layers)
        impl = next((getattr(m, "impl", None) for m in layers.values()
                     if hasattr(m, "impl")), None)
        return {"active": buffers is not None,
                "impl": None if impl is None else type(impl).__name__,
                "masked_steps": 0 if buffers is None else buffers.masked_steps,
                # layer calls that took the split way (eager steps and captures)
                "split_layers": getattr(buffers, "split_layers", 0)}

    def specplug_registration_state(self) -> dict:
        from vllm_specplug.plugin import registration_state

        return registration_state()

    def specplug_kernel_override(self, name: str) -> str | None:
        """Qualified name of the implementation vLLM's kernel dispatcher
        routes `name` to in this worker (None: the original kernel)."""
        from vllm.triton_utils import dispatcher

        entry = dispatcher._registry.get(name)
        return None if entry is None else f"{entry[1].__module__}.{entry[1].__qualname__}"

    def specplug_break_tree_verifier(self) -> str:
        """Swap this worker's tree sampler for one that accepts every first
        child (a deliberately wrong verifier: the distribution tests must
        catch it). Returns the class now in place."""
        from vllm_specplug.integration.v1.tree_sampler import TreeRejectionSampler

        runner = self.model_runner
        if not isinstance(runner.rejection_sampler, TreeRejectionSampler):
            raise RuntimeError("this engine does not run specplug_eagle3")
        broken = _always_accept_class()
        runner.rejection_sampler.__class__ = broken
        return broken.__name__


def _always_accept_class():
    from vllm_specplug.integration.v1.tree_sampler import TreeRejectionSampler

    class AlwaysAcceptFirstChild(TreeRejectionSampler):
        @staticmethod
        def random_samples(batch, width, vocab, sampling_metadata, device):
            uniform, exp = TreeRejectionSampler.random_samples(
                batch, width, vocab, sampling_metadata, device)
            return uniform.zero_(), exp  # u = 0 accepts any child the target allows

    return AlwaysAcceptFirstChild


def record_cudagraph_modes(runner) -> None:
    """Wrap this runner's `sample_tokens` (the instance's, nothing global) to
    count the `CUDAGraphStat` vLLM attaches to each step's output."""
    if hasattr(runner, "_specplug_cudagraph_counts"):
        runner._specplug_cudagraph_counts.clear()
        return
    counts: Counter = Counter()
    runner._specplug_cudagraph_counts = counts
    original = runner.sample_tokens

    def sample_tokens(*args, **kwargs):
        output = original(*args, **kwargs)
        inner = getattr(output, "model_runner_output", None) or \
            getattr(output, "_model_runner_output", None) or output
        stat = getattr(inner, "cudagraph_stats", None)
        if stat is not None:
            counts[(stat.num_unpadded_tokens, stat.num_padded_tokens, stat.runtime_mode)] += 1
        return output

    runner.sample_tokens = sample_tokens
