"""The drafting step's top-k kernel alone (`kernels/draft_topk.py`) on a CUDA
GPU, against PyTorch's log_softmax + topk and, with `--baseline FILE`, an
older copy of the kernel module (the same `draft_topk_kernel` signature):

    python3 benchmarks/gpu/bench_draft_topk.py --out $OUT [--baseline old_kernel.py]

Rows are what a tree search's drafting step hands the kernel: batch x frontier
nodes, each frontier node's children taken as its top-k (`topk` k and a
frontier of k nodes after the first step: tree 16 is k=4, the wide trees
8, 16 and 32). Logits are bf16 normal draws x 3 over the vocabulary
(`--vocab`, SmolLM2's 49152 by default), the large entries anywhere in the row
as in a head's output. Times are CUDA-event means over 100 launches captured
in one CUDA graph and replayed (`*_ms`: GPU time, as the drafting runs in
service, inside the head's captured passes), and for ours also launched
eagerly (`ours_eager_ms`: at small shapes the host's launch rate, not the
GPU, sets it; the first H100 run of 2026-12-06 timed only that way and read
the host). Ours and the baseline go through the same `launch_draft_topk`.
`ids_equal` checks the kernel against the reference on each case (float32
logits: ties are rare, but a row of the 2048-row cases can hold one, and
then either order is right).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
from bench_tree_attention import gpu_ms  # same folder: the script's own path

from vllm_specplug.kernels.draft_topk import draft_topk_kernel
from vllm_specplug.proposers.draft_topk import (draft_topk, draft_topk_reference,
                                                launch_draft_topk)

TOPKS = (1, 4, 8, 16, 32)
BATCH_SIZES = (1, 16, 64)


def load_baseline(path: Path):
    """The `draft_topk_kernel` of another copy of the kernel module."""
    spec = importlib.util.spec_from_file_location("draft_topk_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.draft_topk_kernel


def graph_ms(fn, repeats: int = 100) -> float:
    """GPU ms a call of `fn`: `repeats` calls captured in one CUDA graph,
    the graph replayed between two events (no launch cost in the time)."""
    fn()  # compiles and allocates outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def case_row(k: int, batch: int, vocab: int, baseline) -> dict:
    num_rows = batch * (1 if k == 1 else k)
    generator = torch.Generator(device="cuda").manual_seed(k * 1000 + batch)
    logits = torch.randn(num_rows, vocab, generator=generator, device="cuda") * 3
    _, want_ids = draft_topk_reference(logits, k)
    _, ids = draft_topk(logits, k, backend="triton")
    bf16 = logits.to(torch.bfloat16)
    row = {"topk": k, "batch_size": batch, "rows": num_rows, "vocab": vocab,
           "ids_equal": bool(torch.equal(ids, want_ids)),
           "ours_ms": graph_ms(lambda: launch_draft_topk(draft_topk_kernel, bf16, k)),
           "ours_eager_ms": gpu_ms(lambda: draft_topk(bf16, k, backend="triton"), 100),
           "torch_ms": graph_ms(lambda: draft_topk_reference(bf16, k))}
    if baseline is not None:
        _, base_ids = launch_draft_topk(baseline, logits, k)
        row["baseline_ids_equal"] = bool(torch.equal(base_ids, want_ids))
        row["baseline_ms"] = graph_ms(lambda: launch_draft_topk(baseline, bf16, k))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--baseline", type=Path, help="an older kernels/draft_topk.py")
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    baseline = load_baseline(args.baseline) if args.baseline else None
    rows = []
    for k in TOPKS:
        for batch in BATCH_SIZES:
            rows.append(case_row(k, batch, args.vocab, baseline))
            print(json.dumps({key: round(v, 4) if isinstance(v, float) else v
                              for key, v in rows[-1].items()}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_topk_kernel.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
