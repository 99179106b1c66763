"""From prompts to a faster model, on CPU in minutes.

Built-in tiny target -> `extract --regenerate` (the target answers chat prompts
from its training split; hidden states of prompt + answer) -> `train-eagle3`
-> vLLM's built-in `eagle3` method with the trained head, beside an untrained
head of the same shape and no speculation, on held-out prompts.

    .venv/bin/python examples/eagle3_end_to_end.py [--work DIR] [--results PREFIX]

Prints the side-by-side table (tokens/s, ratio, mean acceptance length,
per-position acceptance, exact = same tokens as no speculation) and writes the
training curve PNG. The same steps from a shell:

    vllm-specplug extract --model tiny --prompts p.jsonl --out data --regenerate
    vllm-specplug train-eagle3 --data data --target tiny --out head
    vllm serve <tiny dir> \\
        --speculative-config '{"method": "eagle3", "model": "head", "num_speculative_tokens": 3}'
"""
import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=None, help="working directory (kept)")
    parser.add_argument("--num-train", type=int, default=400)
    parser.add_argument("--num-eval", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--results", default=None,
                        help="write PREFIX.txt and PREFIX.png (e.g. docs/results/eagle3_tiny)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from vllm_specplug.models.build import build_model
    from vllm_specplug.bench.offline import side_by_side
    from vllm_specplug.bench.report import format_offline_table
    from vllm_specplug.models import end_to_end as e2e
    from vllm_specplug.training.plots import plot_agreement

    work = Path(args.work or tempfile.mkdtemp(prefix="specplug-eagle3-"))
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "head" / "checkpoints", ignore_errors=True)
    model_dir = build_model("tiny")
    start = time.perf_counter()
    data_dir, report = e2e.extract_training_data(model_dir, work, args.num_train,
                                                 args.max_new_tokens)
    extract_s = time.perf_counter() - start
    start = time.perf_counter()
    trainer = e2e.train_head(model_dir, data_dir, work / "head", args.epochs, args.k)
    train_s = time.perf_counter() - start
    e2e.write_untrained_head(trainer, work / "untrained")
    rows = side_by_side(
        model_dir, e2e.eval_prompt_ids(model_dir, args.num_eval),
        {"none": None,
         "eagle3-untrained": e2e.eagle3_config(work / "untrained", args.k),
         "eagle3-trained": e2e.eagle3_config(work / "head", args.k)},
        args.max_new_tokens, enforce_eager=True)
    summary = "\n".join([
        f"data: {report.num_samples + report.num_resumed} samples, "
        f"{report.num_tokens} new tokens extracted, {extract_s:.0f} s (engine start "
        f"included); training: {trainer.total_steps} steps in {trainer.state.seconds:.0f} s "
        f"({train_s:.0f} s with data loading), head {sum(p.numel() for p in trainer.head.parameters())} "
        f"parameters, draft vocab {trainer.vocab.size}",
        f"held-out top-1 agreement per step: "
        + " ".join(f"{a:.3f}" for a in trainer.state.history[-1]["agreement"]),
        f"{args.num_eval} held-out chat prompts, {args.max_new_tokens} new tokens, greedy, "
        f"K={args.k}:", format_offline_table(rows)])
    print(summary)
    curve = plot_agreement(trainer.state.history, work / "training_curve.png",
                           "EAGLE-3 head on the tiny target: held-out agreement")
    if args.results:
        Path(args.results + ".txt").write_text(summary + "\n")
        shutil.copy(curve, args.results + ".png")
    print(f"work directory: {work}")


if __name__ == "__main__":
    main()
