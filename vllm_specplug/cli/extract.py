"""`vllm-specplug extract`: prompts (chat JSONL) -> hidden-state dataset.

    vllm-specplug extract --model M --prompts FILE.jsonl --out DIR \\
        [--layers 2 3 4 6] [--regenerate] [--max-new-tokens N]

Resumable: run it again with the same arguments and finished samples are kept.
Exit codes: 2 bad arguments or input (nothing done), 1 a write failed mid-run
(disk full: free space and re-run, it resumes). Format: docs/extraction.md.
"""
from __future__ import annotations

import os
import sys


def add_parser(sub) -> None:
    parser = sub.add_parser("extract", help="write the target's hidden states for "
                            "chat prompts as a sharded safetensors dataset")
    parser.add_argument("--model", required=True,
                        help="local HF model directory, or 'tiny' for the built-in")
    parser.add_argument("--prompts", required=True, help="JSONL, one conversation "
                        'per line: {"messages": [{"role": ..., "content": ...}]}')
    parser.add_argument("--out", required=True, help="dataset directory")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="layer ids (l = residual stream entering layer l; "
                        "n = after the last layer). Default: EAGLE-3's three "
                        "layers plus n")
    parser.add_argument("--regenerate", action="store_true",
                        help="the target writes the final assistant turn")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=32,
                        help="samples per engine batch and per shard")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.set_defaults(func=run)
    export = sub.add_parser("export-speculators", help="one safetensors file per "
                            "sample (token_ids, hidden_states, loss_mask)")
    export.add_argument("--data", required=True, help="dataset from `extract`")
    export.add_argument("--out", required=True)
    export.set_defaults(func=run_export)


def run(args) -> int:
    from vllm_specplug.models.named import resolve_model

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm_specplug.extraction.errors import OutputWriteError
    from vllm_specplug.extraction.pipeline import ExtractOptions, run_extract

    if args.max_new_tokens < 1 or args.batch_size < 1:
        print("error: --max-new-tokens and --batch-size must be >= 1", file=sys.stderr)
        return 2
    options = ExtractOptions(
        model=resolve_model(args.model), prompts=args.prompts, out=args.out,
        layer_ids=args.layers, regenerate=args.regenerate,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        batch_size=args.batch_size, max_model_len=args.max_model_len)
    try:
        report = run_extract(options)
    except OutputWriteError as error:      # disk full mid-run: resumable
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as error:   # bad input, before any work
        print(f"error: {error}", file=sys.stderr)
        return 2
    rate = report.num_tokens / report.extract_seconds if report.extract_seconds else 0
    per_k = report.bytes_on_disk / max(1, _dataset_tokens(args.out)) * 1000
    print(f"wrote {report.num_samples} samples ({report.num_tokens} tokens) in "
          f"{report.seconds:.1f} s; extraction {rate:.0f} tokens/s; "
          f"{report.num_resumed} already done, {report.num_recovered} recovered, "
          f"{len(report.errors)} lines skipped; {per_k / 1e6:.3f} MB per 1k tokens "
          f"on disk; dataset at {args.out}")
    return 0


def _dataset_tokens(out: str) -> int:
    from vllm_specplug.extraction.dataset import read_manifest

    return sum(r.num_tokens for r in read_manifest(out))


def run_export(args) -> int:
    from vllm_specplug.extraction.errors import OutputWriteError
    from vllm_specplug.extraction.speculators import export_speculators

    try:
        count = export_speculators(args.data, args.out)
    except OutputWriteError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"exported {count} samples to {args.out}")
    return 0
