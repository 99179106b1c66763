"""The V1 runner's drafter protocol: what `patches/gpu_model_runner.py` asks
of a vllm-specplug drafter, in one base class, so the patches make one
decision (is the runner's drafter ours?) and every drafter answers each hook
for itself: `SpecplugDrafter` (model-free, drafter.py) and `TreeEagleDrafter`
(heads, tree_drafter.py). Model Runner V2's counterpart is
`v2/speculator.V2SpeculatorHooks`.
"""
from __future__ import annotations

from vllm_specplug.integration.batch_schedule import BatchPolicyView


class V1DrafterHooks(BatchPolicyView):
    """Runner hooks; the defaults are what a drafter that needs none does."""

    # False: with the target sharded, only the rank whose drafts reach the
    # scheduler drafts (the scheduler sends them to every rank), and the
    # others take `no_drafts`. Trees keep per-rank state, so they draft on
    # every rank.
    drafts_on_every_rank = True
    # True: a step that verifies no draft at all samples as a step without
    # speculation (vLLM's plain sampler, not its rejection sampler over zero
    # drafts; patches/gpu_model_runner.py). A drafter that reads the step's
    # verification metadata even then (trees: their ingest rows) keeps False.
    plain_steps_without_drafts = False

    def no_drafts(self, runner) -> list[list[int]]:
        """A rank's drafts when another rank drafts for it."""
        raise NotImplementedError

    def propose(self, *args, **kwargs):
        raise RuntimeError("vllm-specplug's model-runner hook is not installed in this "
                           "worker; the plugin did not register here")

    def propose_for_runner(self, runner, scheduler_output, sampled_token_ids,
                           outputs: dict) -> list[list[int]]:
        """Drafts per row of `runner.input_batch`. `outputs` holds the
        step's `hidden_states`, `aux_hidden_states`, `sample_hidden_states`
        and `spec_decode_metadata` (each drafter reads what it needs)."""
        raise NotImplementedError

    def draft_tree_parents(self) -> dict[str, list[int]]:
        """{req_id: parents, root included} of the drafts just made that form
        trees, not chains (the scheduler checks grammars per node with them:
        integration/grammar_trees.py)."""
        return {}

    def on_request_removed(self, req_id: str) -> None:
        """The runner dropped a finished or aborted request."""

    def after_prepare_inputs(self, runner, scheduler_output) -> None:
        """The step's inputs are laid out (before the forward)."""

    def setup_runner(self, runner, vllm_setup, target_has_aux_hidden_states: bool) -> None:
        """Where vLLM sets up its own eagle3's runner state
        (`_setup_eagle3_aux_hidden_state_outputs`); `vllm_setup()` runs
        vLLM's own; the target exposes auxiliary hidden states when vLLM's
        `SupportsEagle3` interface says so."""
        vllm_setup()
