"""`specplug_eagle3`: EAGLE-3 heads drafting EAGLE-2 dynamic trees inside vLLM.

EAGLE-3 (arXiv 2503.01840) heads draft from the target's auxiliary hidden
states; EAGLE-2 (arXiv 2406.16858) expands the best `topk` nodes by path
score for `num_steps` levels and keeps the best `num_draft_tokens - 1` as a
tree that the target verifies in one forward (SGLang's
`speculative_eagle_topk`, `speculative_num_steps`,
`speculative_num_draft_tokens`). `topk=1` is the chain vLLM's `eagle3` drafts.

This module holds the options (validated in the front end, with the target's
config, before any engine starts) and the proposer, which owns the head
(`eagle3_head.py`). The engine side (tree positions, tree attention, tree
verification, KV compaction) lives in `integration/tree_*.py`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from vllm_specplug.proposers.base import (ProposeBatch, Proposer, ProposerConfigError,
                                          ProposerOptions, require)
from vllm_specplug.proposers.lookup import check_lookup_options

TREE_DRAFTER_QUALNAME = "vllm_specplug.integration.v1.tree_drafter.TreeEagleDrafter"
DEFAULT_NUM_STEPS = 5
METHOD = "specplug_eagle3"
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")
TREE_ATTENTION_WAYS = ("split", "rewrite")
DRAFT_ATTENTION_WAYS = ("auto", "triton", "torch")  # draft_attention (proposers/head_attention.py)
FIRST_STEP_MASKS = "first"  # grammar_drafts: mask the first drafting step only
AUTO_DRAFT_COMPILE = "auto"  # draft_compile: where the drafting passes are CUDA graphs
SCHEDULER_ROWS = "scheduler"  # vLLM's deferred step fills them (the default: "worker")
GRAMMAR_ROWS_WAYS = ("worker", SCHEDULER_ROWS)  # who fills a constrained step's verification rows
AUTO_ROW_DEPTH = "auto"
ROW_DEPTHS = (AUTO_ROW_DEPTH, "full")  # grammar_row_depth
AUTO_ROW_THREADS = "auto"  # grammar_row_threads (integration/row_threads.py)
FULL_TREE_ROWS = "full"  # grammar_tree_rows: every node's row
CHOICES_VERIFY = "choices"  # grammar_verify: every greedy batch's trees from the target's choices
AUTO_VERIFY = "auto"  # grammar_verify: choices from grammar_choices_min_trees trees a step on
GRAMMAR_VERIFY_WAYS = ("rows", CHOICES_VERIFY, AUTO_VERIFY)  # (integration/grammar_choices.py)


@dataclass(frozen=True)
class TreeOptions(ProposerOptions):
    """EAGLE-2 tree shape, shared by every tree drafter (EAGLE-3, MTP)."""
    method_name: ClassVar[str] = "tree"   # the method errors name
    topk: int = 1  # beam width per draft step (1 = chain)
    num_steps: int | None = None  # draft depth; default num_speculative_tokens or 5
    num_draft_tokens: int | None = None  # tree size incl. the root; default 1 + num_steps
    # Divides the drafter's logits before path scores are summed: < 1 trusts
    # it more (deeper trees), > 1 less (wider). Selection only: verification
    # uses the target's distribution alone, so any value is lossless.
    draft_temperature: float = 1.0
    # > 0: a chain's request whose last n tokens (prompt_lookup_min <= n <=
    # prompt_lookup_max) recur in its history drafts what followed them, not
    # the head's chain (proposers/lookup.py: loops and copies). 0: off.
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 5
    # The tokens a tree's lookup drafts: 0 (the default) its depth,
    # num_steps; more lets a lookup's branch reach below the head's nodes
    # (at most num_draft_tokens - 1; a chain's lookup is its num_steps).
    prompt_lookup_tokens: int = 0
    # On CUDA, replay each drafting pass as a captured CUDA graph (off under
    # enforce_eager). False drafts eagerly: slower, same trees.
    draft_cudagraph: bool = True
    # The drafter's dense steps (projections, norms, rope, MLP, logits)
    # through torch.compile (inductor), which fuses their elementwise
    # kernels, as vLLM compiles its own eagle3 head (proposers/draft_compile.py),
    # inside the captured drafting passes. "auto": where the passes are
    # captured as CUDA graphs (CUDA, not enforce_eager), not on CPU. Start-up
    # compiles them (about 20 s). Selection only: lossless either way. On the
    # H200 tree 16 compiled ran 1.28x / 1.23x / 1.25x vLLM's eagle3 K=5 at
    # batch 1 / 16 / 64 (eager 1.11x / 1.09x / 1.10x; docs/results/v2_tiny3_aa_h200).
    draft_compile: bool | str = AUTO_DRAFT_COMPILE
    # The drafter's weights and activations: "auto" is the target's dtype,
    # as vLLM's eagle3 runs its head; "float32" costs about twice the time of
    # bfloat16 on a GPU (the 8B-shaped head is bandwidth-bound at batch 1 and
    # compute-bound at 64). Selection only: any dtype is lossless.
    draft_dtype: str = "auto"
    # The drafter's attention over its cache (proposers/head_attention.py):
    # "auto" is our Triton kernel reading the cache in place on CUDA (since
    # 2026-11-27) and the PyTorch path elsewhere; "torch" the PyTorch path
    # (einsums over copied keys; CUDA's before then). Selection only:
    # lossless either way. On the H200 our chain's τ on SmolLM2 (bf16) fell
    # to 0.95x vLLM's eagle3 with the same head after these changes, not on
    # CPU (docs/results/smollm2_sets_large_h200): this option is how an
    # engine tells the kernel's part.
    draft_attention: str = "auto"
    # How tree rows get their attention on FlashAttention 3 (CUDA): "split"
    # attends to the prefix with FlashAttention and to the tree with our
    # kernel, merged by log-sum-exp (the cache is read once); "rewrite" lets
    # the backend attend causally, then recomputes tree rows over the whole
    # cache. Both are exact; other backends always rewrite.
    tree_attention: str = "split"
    # Under structured outputs, each drafting step ranks only the tokens the
    # request's grammar allows on that node's path. None (the default):
    # every step on the V1 runner; the first step only ("first") on Model
    # Runner V2, where its masks ride in the graphed pass
    # (integration/v2/root_masks.py): on SmolLM2 under a JSON schema (H200)
    # tree 16's τ rose 3-8% at the speed of unmasked drafting
    # (docs/results/v2_grammar_first_smollm2_h200), where masking every step
    # there drafts eagerly, the host walking the grammar node by node
    # between the head's steps: our chain ran so at a third of vLLM's
    # eagle3's tokens/s (docs/results/v2_grammar_smollm2_h200). true: every
    # step on both; false: none; "first": the first step on both.
    # Selection only: the scheduler still checks every node, so every way
    # is lossless.
    grammar_drafts: bool | str | None = None
    # Who fills the verification rows of a constrained request's step under
    # async scheduling on Model Runner V2 (integration/worker_rows.py):
    # "worker" (the default) fills them in the worker, from its own grammar
    # and the drafts it just made, and the engine core defers no step;
    # "scheduler" is vLLM's way: the engine core waits for the previous
    # step's output and drafts, then fills them. Both are exact on the H200
    # (tests/gpu/test_grammar_trees_cuda.py); on SmolLM2 under a JSON
    # schema the worker's rows ran 1.13x the scheduler's at batch 16 and 64
    # (every repeat faster), within the noise at batch 1
    # (docs/results/v2_worker_rows_h200_run2). Elsewhere (the V1 runner, a
    # reasoning parser, a scheduler of the user's) the scheduler fills them.
    grammar_rows: str = "worker"
    # How deep a chain's rows filled in the worker go (integration/worker_rows.py
    # `RowDepth`): "auto" (the default) only as deep as drafts get accepted,
    # from the acceptance the worker sees (every row one step in 16); "full":
    # every draft's. Exact either way: a draft without its row is rejected.
    grammar_row_depth: str = AUTO_ROW_DEPTH
    # Host threads that run xgrammar's walks of those rows' trees in the
    # worker, one request's beside another's, once a step has 128 rows
    # (integration/row_threads.py): "auto" (the default) takes vLLM's own
    # fill pool's size (half the CPUs, at most 8); 1 walks them in turn.
    # Exact either way. On the H200 at batch 64 under a JSON schema "auto"
    # cut the worker's grammar phase 10.6 -> 6.1 ms a step and ran 1.19x
    # [0.97-1.51] one thread's speed (docs/results/v2_schema_threads_h200).
    grammar_row_threads: int | str = AUTO_ROW_THREADS
    # A tree's rows filled in the worker (integration/worker_rows.py):
    # "full" (the default) every node's; an integer N, only its first N
    # drafts' (node order: a parent before its children, drafting step by
    # step, so they form a subtree), the others not acceptable. Exact either
    # way (a draft not acceptable is a draft rejected): it trades the deep
    # nodes' accepted tokens for the walks' host time, which held the step
    # at batch 64 under a JSON schema on the H200
    # (docs/results/v2_schema_threads_h200). On the H200 it did not pay: 8
    # rows ran 0.91x / 0.90x / 1.06x every row's speed at batch 1 / 16 / 64,
    # 4 rows 0.94x at 64; a tree's walk costs about as much for 4 nodes as
    # for 16 (docs/results/v2_schema_tree_rows_h200).
    grammar_tree_rows: int | str = FULL_TREE_ROWS
    # How a greedy request's constrained tree is verified: "rows" (the
    # default) masks every node's logits with its row before sampling;
    # "choices" leaves them unmasked and decides each node of the accepted
    # path from the target's argmax and top-k, a row only where those are
    # all forbidden (verification/grammar_greedy.py,
    # integration/grammar_choices.py): one wait for the forward a step
    # instead of every node's row. On the V1 runner the scheduler leaves
    # those trees out of its rows (integration/v1/tree_choices.py); on Model
    # Runner V2 the worker does, with rows in the worker and in batches
    # that sample greedily throughout. Exact either way
    # (tests/test_grammar_greedy.py, tests/test_grammar_choices_engine.py).
    # On CPU 64 trees of 16 nodes took 0.83 ms of host against the rows'
    # 5.18 ms (docs/results/grammar_greedy_cpu); on the H200 exact, the host
    # step 0.6-0.8 ms lower, speed within the spread of every row's
    # (docs/results/v2_schema_choices_h200): opt-in until a run shows more.
    # There the choices ran 0.90x / 1.12x / 1.27x every row's speed at batch
    # 1 / 16 / 64, and a wide tree's 1.21x [1.07-1.34] at batch 16
    # (docs/results/smollm2_schema_wide_choices_h200_s62): alone, one tree's
    # walk is cheap and the choices' wait for the forward is not. "auto"
    # takes the choices on a step with at least `grammar_choices_min_trees`
    # constrained greedy trees and rows on the others, decided step by step:
    # exact on the V1 runner; refused on Model Runner V2, where it was not
    # (`check_model_runner_v2`).
    grammar_verify: str = "rows"
    # The fewest constrained greedy trees a step for "auto" to take the
    # choices. Measured: rows faster alone (1 tree), choices at 16 and 64;
    # 8 lies between, not measured there.
    grammar_choices_min_trees: int = 8

    def validate(self, name: str) -> None:
        require(self.topk >= 1, name, f"topk={self.topk} must be >= 1")
        check_lookup_options(self, name)
        require(self.tree_attention in TREE_ATTENTION_WAYS, name,
                f"tree_attention={self.tree_attention!r} must be one of "
                f"{', '.join(TREE_ATTENTION_WAYS)}")
        require(self.draft_dtype in DRAFT_DTYPES, name,
                f"draft_dtype={self.draft_dtype!r} must be one of {', '.join(DRAFT_DTYPES)}")
        require(self.draft_attention in DRAFT_ATTENTION_WAYS, name,
                f"draft_attention={self.draft_attention!r} must be one of "
                f"{', '.join(DRAFT_ATTENTION_WAYS)}")
        require(self.draft_compile in (True, False, AUTO_DRAFT_COMPILE), name,
                f"draft_compile={self.draft_compile!r} must be true, false or "
                f"{AUTO_DRAFT_COMPILE!r} (compiled where the drafting passes are CUDA graphs)")
        require(self.draft_temperature > 0, name,
                f"draft_temperature={self.draft_temperature} must be > 0")
        require(not isinstance(self.grammar_drafts, str)
                or self.grammar_drafts == FIRST_STEP_MASKS, name,
                f"grammar_drafts={self.grammar_drafts!r} must be true, false or "
                f"{FIRST_STEP_MASKS!r} (the first drafting step only)")
        require(self.grammar_row_depth in ROW_DEPTHS, name,
                f"grammar_row_depth={self.grammar_row_depth!r} must be one of "
                f"{', '.join(ROW_DEPTHS)}")
        require(_word_or_count(self.grammar_row_threads, AUTO_ROW_THREADS), name,
                f"grammar_row_threads={self.grammar_row_threads!r} must be "
                f"{AUTO_ROW_THREADS!r} or an integer >= 1 (1: one thread)")
        require(_word_or_count(self.grammar_tree_rows, FULL_TREE_ROWS), name,
                f"grammar_tree_rows={self.grammar_tree_rows!r} must be "
                f"{FULL_TREE_ROWS!r} or an integer >= 1 (drafts with rows a tree)")
        require(self.grammar_verify in GRAMMAR_VERIFY_WAYS, name,
                f"grammar_verify={self.grammar_verify!r} must be one of "
                f"{', '.join(GRAMMAR_VERIFY_WAYS)}")
        require(isinstance(self.grammar_choices_min_trees, int)
                and not isinstance(self.grammar_choices_min_trees, bool)
                and self.grammar_choices_min_trees >= 1, name,
                f"grammar_choices_min_trees={self.grammar_choices_min_trees!r} must be an "
                "integer >= 1 (the fewest constrained greedy trees a step for "
                "grammar_verify \"auto\" to take the choices)")
        require(self.grammar_rows in GRAMMAR_ROWS_WAYS, name,
                f"grammar_rows={self.grammar_rows!r} must be one of "
                f"{', '.join(GRAMMAR_ROWS_WAYS)}")
        if self.num_steps is not None:
            require(self.num_steps >= 1, name, f"num_steps={self.num_steps} must be >= 1")
        if self.num_draft_tokens is not None and self.num_steps is not None:
            most = 1 + self.topk * self.num_steps
            require(2 <= self.num_draft_tokens <= most, name,
                    f"num_draft_tokens={self.num_draft_tokens} must be in [2, 1 + topk * "
                    f"num_steps = {most}]: raise topk or num_steps, or lower it")

    def choices_min_trees(self) -> int | None:
        """The fewest constrained greedy trees a step verified from the
        target's choices (`grammar_verify`): None never ("rows"), 1 every
        such step ("choices"), else `grammar_choices_min_trees` ("auto")."""
        if self.grammar_verify == CHOICES_VERIFY:
            return 1
        return self.grammar_choices_min_trees if self.grammar_verify == AUTO_VERIFY else None

    def check_model_runner_v2(self) -> None:
        """Options Model Runner V2 refuses: `grammar_verify: "auto"` gave a
        token no speculation does not on an H100 in float32, twice, where
        "choices" and "rows" alone were exact (a regex batch switching
        between them; docs/results/v2_grammar_auto_h100), though exact six
        times on another H100 and an H200 (v2_grammar_auto_h100_s64). A
        candidate cause, a race, was fixed on 2026-12-06: padded rows of a
        drafting pass allowed every token where the last request's grammar
        masked its first step, drafting another tree into that request's
        slot (integration/v2/root_masks.py). The refusal stays until a GPU
        run shows "auto" exact again."""
        if self.grammar_verify == AUTO_VERIFY:
            raise ProposerConfigError(
                f"speculative_config for method {self.method_name!r}: grammar_verify='auto' "
                "is not lossless on Model Runner V2 yet (docs/results/v2_grammar_auto_h100); "
                "use 'choices' (batches of many constrained requests) or 'rows'")

    @property
    def lookup_num_tokens(self) -> int:
        """The tokens a prompt lookup drafts (`prompt_lookup_tokens`, or the
        tree's depth)."""
        return self.prompt_lookup_tokens or self.num_steps

    @property
    def verified_depth(self) -> int:
        """The deepest node a step may verify: the drafting depth, or a
        prompt lookup's branch below it (`prompt_lookup_tokens`)."""
        if not self.prompt_lookup_min:
            return self.num_steps
        return max(self.num_steps, self.lookup_num_tokens)

    def masks_drafts(self) -> bool:
        """Whether drafts are ranked among grammar-valid tokens (on either
        runner; how many steps: `masks_first_step_only`)."""
        return self.grammar_drafts is None or bool(self.grammar_drafts)

    def masks_first_step_only(self, model_runner_v2: bool) -> bool:
        """Whether only the first drafting step is masked on this runner
        (`grammar_drafts: "first"`, the default on Model Runner V2)."""
        if self.grammar_drafts is None:
            return model_runner_v2
        return self.grammar_drafts == FIRST_STEP_MASKS

    def resolved(self, num_speculative_tokens: int | None):
        """Defaults filled: num_steps from num_speculative_tokens, the tree
        size from num_steps (a chain when topk=1)."""
        steps = self.num_steps or num_speculative_tokens or DEFAULT_NUM_STEPS
        resolved = dataclasses.replace(self, num_steps=steps,
                                       num_draft_tokens=self.num_draft_tokens or 1 + steps)
        resolved.validate(self.method_name)
        return resolved


@dataclass(frozen=True)
class Eagle3TreeOptions(TreeOptions):
    method_name: ClassVar[str] = METHOD
    model: str = ""  # head directory, as vLLM's eagle3 loads it

    def validate(self, name: str) -> None:
        require(bool(self.model), name, "model is required: the EAGLE-3 head directory "
                "(config.json + model.safetensors, e.g. from `vllm-specplug "
                "train-eagle3` or `vllm-specplug build-model tiny-eagle3`)")
        super().validate(name)


def read_head_config(name: str, head_dir: str) -> dict[str, Any]:
    path = Path(head_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ProposerConfigError(
            f"speculative_config for method {name!r}: model={head_dir!r} has no "
            "config.json: give the directory of an EAGLE-3 head") from None
    except (OSError, ValueError) as error:
        raise ProposerConfigError(f"speculative_config for method {name!r}: {path} is "
                                  f"unreadable ({error})") from error


def check_head_fits_target(name: str, options: Eagle3TreeOptions, target_hf) -> None:
    """A head whose shapes do not fit the target fails here, naming the field."""
    head = read_head_config(name, options.model)
    hidden = int(getattr(target_hf, "hidden_size"))
    layers = int(getattr(target_hf, "num_hidden_layers"))
    vocab = int(getattr(target_hf, "vocab_size"))
    head_target_hidden = int(head.get("target_hidden_size") or head.get("hidden_size", -1))
    require(head_target_hidden == hidden, name,
            f"the head's target_hidden_size {head_target_hidden} != the target's "
            f"hidden_size {hidden}: the head was trained for another model")
    require(int(head.get("vocab_size", -1)) == vocab, name,
            f"the head's vocab_size {head.get('vocab_size')} != the target's {vocab}")
    aux = head.get("eagle_aux_hidden_state_layer_ids") or []
    require(len(aux) > 0 and all(0 <= int(i) <= layers for i in aux), name,
            f"the head's eagle_aux_hidden_state_layer_ids {aux} do not fit a target "
            f"of {layers} layers")
    draft_vocab = int(head.get("draft_vocab_size") or vocab)
    require(options.topk <= draft_vocab, name,
            f"topk={options.topk} exceeds the head's draft vocabulary ({draft_vocab})")
    from vllm_specplug.proposers.eagle3_loading import head_tensor_problems

    try:
        problems = head_tensor_problems(options.model)
    except Exception as error:  # unreadable file or config: say which
        raise ProposerConfigError(f"speculative_config for method {name!r}: model="
                                  f"{options.model!r} is not a loadable EAGLE-3 head "
                                  f"({type(error).__name__}: {error})") from error
    require(not problems, name, f"model={options.model!r}: the head's tensors do not "
            f"match its config.json: {'; '.join(problems)}")
    check_tree_attention_fits(name, options, target_hf)


def _word_or_count(value, word: str) -> bool:
    """`value` is `word` or an integer >= 1 (not a bool)."""
    return value == word or (isinstance(value, int) and not isinstance(value, bool)
                             and value >= 1)


def check_tree_attention_fits(name: str, options: TreeOptions, target_hf) -> None:
    for field_name in ("sliding_window", "attn_logit_softcapping"):
        if options.topk > 1 and getattr(target_hf, field_name, None):
            raise ProposerConfigError(
                f"speculative_config for method {name!r}: topk={options.topk} needs tree "
                f"attention, which does not support the target's {field_name} yet; use "
                "topk=1")


class TreeProposer(Proposer):
    """A drafter of EAGLE-2 trees from the target's hidden states, driven by
    a worker-side drafter (`integration/v1/tree_drafter.py`), not through the
    token-history `propose` of model-free methods."""
    options_cls: ClassVar[type[ProposerOptions]] = TreeOptions
    uses_hidden_states: ClassVar[bool] = True
    # Model Runner V2 on CUDA (integration/v2/), the V1 runner elsewhere.
    runs_on_model_runner_v2: ClassVar[bool] = True
    # Per-step tree sizes from live acceptance and measured costs
    # (adaptive/tree_budget.py), on the V1 runner; asked for with
    # "adaptive": true until measured on Model Runner V2 (issue 27).
    supports_adaptive: ClassVar[bool] = True
    adaptive_by_default: ClassVar[bool] = False

    @classmethod
    def fills_draft_confidences(cls, options: TreeOptions) -> bool:
        """Chains do: vLLM's acceptance estimator reads each draft step's
        logits inside the graphed drafting pass. A tree's nodes are not
        chain positions, and its size is its own budget; a chain's prompt
        lookups (`prompt_lookup_min`) carry no head confidences."""
        return options.topk == 1 and not options.prompt_lookup_min

    @classmethod
    def vllm_num_speculative_tokens(cls, options: TreeOptions,
                                    num_speculative_tokens: int | None) -> int:
        """What vLLM's scheduler must allow per step: every tree node but the root."""
        return options.resolved(num_speculative_tokens).num_draft_tokens - 1

    @classmethod
    def load_drafter(cls, options: TreeOptions, target_dir: str):
        """The method's one-layer drafter (`draft_layers.LoadedDrafter`)."""
        raise NotImplementedError

    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        raise ProposerConfigError(
            f"{type(self).__name__} drafts trees from the target's hidden states and is "
            f"driven by {self.drafter_qualname}; it has no token-history propose()")


class Eagle3TreeProposer(TreeProposer):
    """Drafts EAGLE-2 trees with an EAGLE-3 head (`TreeEagleDrafter`)."""
    options_cls: ClassVar[type[ProposerOptions]] = Eagle3TreeOptions
    drafter_qualname: ClassVar[str] = TREE_DRAFTER_QUALNAME

    @classmethod
    def check_target(cls, name: str, options: Eagle3TreeOptions, target_hf) -> None:
        check_head_fits_target(name, options, target_hf)

    @classmethod
    def load_drafter(cls, options: Eagle3TreeOptions, target_dir: str):
        """The head directory's EAGLE-3 head (`LoadedDrafter`), in float32."""
        from vllm_specplug.proposers.draft_layers import LoadedDrafter
        from vllm_specplug.proposers.eagle3_loading import load_head

        head = load_head(options.model)
        return LoadedDrafter(f"head {options.model}", tuple(head.config.aux_layer_ids), head)


def chain_parents(num_nodes: int) -> np.ndarray:
    """Parents of a chain of `num_nodes` nodes (root included)."""
    return np.arange(-1, num_nodes - 1, dtype=np.int64)


def is_chain(parent_ids: np.ndarray) -> bool:
    return bool(np.array_equal(parent_ids, chain_parents(len(parent_ids))))

