"""Our speculation's per-step decisions in vLLM's Prometheus metrics
(`vllm.stat_logger_plugins` entry point; a server's `/metrics`).

vLLM's own counters (`vllm:spec_decode_*`) are cumulative: they give the
mean draft length over a run, not what each step chose. The adaptive
controllers choose per step (per request on the V1 runner, one length for
the batch under async scheduling: adaptive/), so this logger adds, for
engines running one of our methods, from the scheduler's per-step stats:

- `specplug:draft_tokens_per_request`: a histogram of each step's
  draft tokens per request that drafted (the chosen K or tree size);
- `specplug:tokens_per_request`: a histogram of each step's realised
  tokens per drafting request (1 + accepted);
- `specplug:steps_without_drafts`: steps with requests running and no
  draft token verified (the controller chose no speculation, or every
  request was prefilling);
- with the batch policy (one length per step, adaptive/batch_draft_length.py),
  through its channel from the engine core (integration/policy_channel.py):
  `specplug:batch_draft_length` (the length it runs now), and the sums
  `specplug:expected_tokens_total` and `specplug:realised_tokens_total` over
  `specplug:observed_requests_total` (tokens per request it expected of the
  length it chose, and those that came: their rates' ratio is the
  estimate's bias).

vLLM loads stat logger plugins in `AsyncLLM` (`vllm serve`), not in the
offline `LLM`; `vllm-specplug bench offline` reads the controllers' own
counters instead.
"""
from __future__ import annotations

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_specplug.integration.policy_channel import PolicyChannelReader, channel_path

DRAFT_BUCKETS = (0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 8.5, 16.5, 32.5, 64.5)
TOKEN_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
# Not under "vllm:": vLLM's Prometheus logger, made after the plugins',
# unregisters every "vllm:" collector first (unregister_vllm_metrics)
NAMES = ("specplug:draft_tokens_per_request", "specplug:tokens_per_request",
         "specplug:steps_without_drafts")
# the batch policy's (read from its channel): counters of its sums, a gauge of its length
POLICY_SUMS = {"expected_tokens": "specplug:expected_tokens",
               "realised_tokens": "specplug:realised_tokens",
               "num_requests": "specplug:observed_requests"}
POLICY_LENGTH = "specplug:batch_draft_length"


class SpecplugStatLogger(StatLoggerBase):
    """Per-step draft lengths and realised tokens of our methods."""

    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        from vllm_specplug.integration.config import selection_of

        spec = vllm_config.speculative_config
        self.enabled = spec is not None and selection_of(spec) is not None
        if not self.enabled:
            return
        from prometheus_client import Counter, Histogram

        _unregister(NAMES + tuple(POLICY_SUMS.values()) + (POLICY_LENGTH,))
        labels = {"model_name": vllm_config.model_config.served_model_name,
                  "engine": str(engine_index)}
        names = list(labels)
        self.draft_tokens = Histogram(
            NAMES[0], "Draft tokens per drafting request, per step (chosen K or tree size).",
            names, buckets=DRAFT_BUCKETS).labels(**labels)
        self.tokens = Histogram(
            NAMES[1], "Tokens emitted per drafting request, per step (1 + accepted).",
            names, buckets=TOKEN_BUCKETS).labels(**labels)
        self.no_drafts = Counter(
            NAMES[2], "Steps with running requests that verified no draft token.",
            names).labels(**labels)
        self._policy_metrics(labels)
        self.channel = PolicyChannelReader(channel_path(vllm_config, engine_index))
        self.last_sums = dict.fromkeys(POLICY_SUMS, 0.0)

    def _policy_metrics(self, labels: dict) -> None:
        from prometheus_client import Counter, Gauge

        names = list(labels)
        self.policy_sums = {field: Counter(name, f"Batch draft-length policy: {field} summed "
                                           "over the requests it observed.", names)
                            .labels(**labels) for field, name in POLICY_SUMS.items()}
        self.policy_length = Gauge(POLICY_LENGTH, "Batch draft-length policy: the draft "
                                   "length (or tree size) it runs now.", names).labels(**labels)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
               engine_idx: int = 0) -> None:
        if not self.enabled or scheduler_stats is None:
            return
        self._read_policy()
        spec = scheduler_stats.spec_decoding_stats
        if spec is None or spec.num_drafts == 0:
            if scheduler_stats.num_running_reqs > 0:
                self.no_drafts.inc()
            return
        self.draft_tokens.observe(spec.num_draft_tokens / spec.num_drafts)
        self.tokens.observe(1.0 + spec.num_accepted_tokens / spec.num_drafts)

    def _read_policy(self) -> None:
        """The batch policy's sums since the last read (a sum that went down:
        the engine's policy was replaced, counted from zero again)."""
        values = self.channel.read()
        if values is None:
            return
        self.policy_length.set(values["current"])
        for field, counter in self.policy_sums.items():
            now, before = values[field], self.last_sums[field]
            counter.inc(now - before if now >= before else now)
            self.last_sums[field] = now

    def log_engine_initialized(self) -> None:
        return None


def _unregister(names: tuple[str, ...]) -> None:
    """An earlier engine's collectors of ours (one registry per process;
    vLLM unregisters its own the same way). With data parallelism the last
    engine's are kept."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", None) in {n.removesuffix("_total") for n in names}:
            REGISTRY.unregister(collector)
