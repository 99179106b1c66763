"""`vllm-specplug train-mtp`: an MTP layer for a target, served by vLLM's `mtp`.

    vllm-specplug train-mtp --data DIR --target MODEL --out MODEL_DIR
    vllm serve MODEL_DIR --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'

DIR comes from `vllm-specplug extract` on the same target (its last layer is
the one the MTP layer reads). MODEL_DIR is the target plus the layer, in
MiMo's layout (a Llama target is written as the equivalent Qwen2 one; see
docs/mtp.md). Resumes from MODEL_DIR/checkpoints (--no-resume starts over).
Exit codes: 2 bad arguments or input (named error, before training), 1 a
write failed (free space and re-run the same command: it resumes).
"""
from __future__ import annotations

from vllm_specplug.cli.train_eagle3 import add_training_args, run_trainer


def add_parser(sub) -> None:
    p = sub.add_parser("train-mtp", help="train an MTP layer (vLLM's `mtp`) on a "
                       "dataset from `vllm-specplug extract`")
    add_training_args(p, out_help="directory of the target with its MTP layer")
    p.set_defaults(func=run)


def run(args) -> int:
    from vllm_specplug.training.mtp_trainer import MtpTrainer

    def describe(trainer) -> str:
        return (f"MTP-capable model written to {args.out} (MTP layer of "
                f"{sum(p.numel() for p in trainer.head.parameters())} parameters; serve "
                "it with speculative_config {\"method\": \"mtp\"})")

    return run_trainer(args, MtpTrainer, describe)
