"""`vllm-specplug train-eagle3`: an EAGLE-3 head vLLM's `eagle3` method loads.

    vllm-specplug train-eagle3 --data DIR --target MODEL --out HEAD_DIR

Resumes from HEAD_DIR/checkpoints when present (--no-resume starts over).
Exit codes: 2 bad arguments or input (named error, before training), 1 a write
failed (disk full: free space and re-run the same command, it resumes).
Writes HEAD_DIR/config.json + model.safetensors (with d2t/t2d),
token_ranking.json (FR-Spec token map), training_log.json, training_curve.png.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("train-eagle3", help="train an EAGLE-3 draft head on a "
                       "dataset from `vllm-specplug extract`")
    add_training_args(p, out_help="head directory")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="default: min(32000, target vocab // 2)")
    p.set_defaults(func=run)


def add_training_args(p, out_help: str) -> None:
    """The arguments every head's training command takes."""
    p.add_argument("--data", required=True, help="dataset directory")
    p.add_argument("--target", required=True,
                   help="target model directory, or 'tiny' for the built-in")
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps")
    p.add_argument("--step-weight", type=float, default=0.8,
                   help="loss weight of unrolled step k is step_weight ** k")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--held-out-fraction", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when torch sees a GPU, else CPU), cpu or cuda; on "
                        "CUDA the head trains under bf16 autocast")
    p.add_argument("--no-resume", action="store_true",
                   help="delete OUT/checkpoints and start over")


def _check(args) -> str | None:
    for name in ("ttt_steps", "epochs", "batch_size", "eval_every", "checkpoint_every"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if not 0 <= args.held_out_fraction < 1:
        return "--held-out-fraction must be in [0, 1)"
    if not 0 < args.step_weight <= 1 or args.lr <= 0:
        return "--step-weight must be in (0, 1] and --lr > 0"
    return None


def run(args) -> int:
    from vllm_specplug.training.trainer import Trainer

    def describe(trainer) -> str:
        return (f"head written to {args.out} ({sum(p.numel() for p in trainer.head.parameters())}"
                f" parameters, draft vocab {trainer.vocab.size})")

    return run_trainer(args, Trainer, describe, draft_vocab_size=args.draft_vocab_size)


def run_trainer(args, trainer_cls, describe, **config_fields) -> int:
    """Check, train (resuming unless --no-resume), plot; exit codes as above."""
    from vllm_specplug.models.named import resolve_model
    from vllm_specplug.files import OutputWriteError
    from vllm_specplug.training.trainer import TrainConfig, run_training

    problem = _check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    config = TrainConfig(
        data=args.data, target=resolve_model(args.target), out=args.out,
        ttt_steps=args.ttt_steps, step_weight=args.step_weight, epochs=args.epochs,
        batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
        held_out_fraction=args.held_out_fraction, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, seed=args.seed, device=args.device,
        **config_fields)
    if args.no_resume:
        shutil.rmtree(Path(args.out) / "checkpoints", ignore_errors=True)
    try:
        trainer = run_training(config, resume=not args.no_resume, trainer_cls=trainer_cls)
        plot = _plot(trainer, Path(args.out) / "training_curve.png")
    except OutputWriteError as error:      # disk full mid-run: resumable
        print(f"error: {error}{_resume_note(args.out)}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as error:   # bad input, before training
        print(f"error: {error}", file=sys.stderr)
        return 2
    last = trainer.state.history[-1]["agreement"]
    print(f"{describe(trainer)}; held-out top-1 agreement per step "
          f"{' '.join(f'{a:.3f}' for a in last)}; {trainer.state.seconds:.1f} s of "
          f"training; curve {plot}")
    return 0


def _plot(trainer, path: Path) -> Path:
    from vllm_specplug.files import OutputWriteError
    from vllm_specplug.training.plots import plot_agreement

    try:
        return plot_agreement(trainer.state.history, path)
    except OSError as error:
        raise OutputWriteError.wrap(error, path) from error


def _resume_note(out: str) -> str:
    from vllm_specplug.training.checkpoint import latest_step

    step = latest_step(out)
    return (f" (the last complete checkpoint is step {step}, "
            f"{Path(out) / 'checkpoints'}; nothing before it is lost)"
            if step is not None else " (no checkpoint was written yet)")
