"""Host work of the V2 head's prefix-cache bookkeeping, on CPU
(`integration/v2/prefix_blocks.py`): B requests of N blocks finish and
their rows are saved by block id (`PrefixBlocks.schedule`), then B new
requests hit every block (a shared first block, as a chat template's
system prompt makes) and adopt the saved rows (`PrefixBlocks.adopt_all`).

The pool is tiny by default (1 KV head of 8), so the time is the host's
(views, concatenations, index tensors), not the copies: on the GPU those
copies are launches and the host work is what a step waits on. On the H200
the bench's phases had these at batch 64 (docs/results/smollm2_recorder_h200):
adopt_prefixes 0.13 ms and save_prefixes 0.18 ms a step, averaged over a
pass's steps, i.e. a few ms in each step where a wave starts or requests end.

    .venv/bin/python benchmarks/bench_prefix_blocks.py --batch 64 --blocks 12 --repeats 20
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK_SIZE = 16


def _output(new=(), finished=()):
    """The fields of a scheduler output that `PrefixBlocks.schedule` reads."""
    return SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=None,
                           scheduled_new_reqs=list(new),
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]))


def _wave(prefix: str, batch: int, num_blocks: int, hit: int, extra: int):
    """New requests: block 0 shared, then their own blocks (and `extra` fresh ones)."""
    return [SimpleNamespace(req_id=f"{prefix}{i}", num_computed_tokens=hit, block_ids=(
        [0] + list(range(1 + i * num_blocks, (i + 1) * num_blocks)) +
        list(range(100_000 + i * extra, 100_000 + (i + 1) * extra)),)) for i in range(batch)]


def one_round(args) -> tuple[float, float, int]:
    """Seconds to save B finished requests and to adopt B hits; hits adopted."""
    from vllm_specplug.integration.v2.prefix_blocks import PrefixBlocks
    from vllm_specplug.proposers.head_cache import HeadCachePool

    batch, num_blocks = args.batch, args.blocks
    positions = num_blocks * BLOCK_SIZE
    pool = HeadCachePool(args.kv_heads, args.head_dim, 64, 128, torch.bfloat16,
                         torch.device("cpu"), num_slots=2 * batch)
    pool.reserve(2 * batch, positions + BLOCK_SIZE)
    pool.valid[:batch, :positions] = True
    tokens = torch.randint(0, 1000, (2 * batch, positions + BLOCK_SIZE))
    blocks, first = PrefixBlocks(BLOCK_SIZE), {f"a{i}": i for i in range(batch)}
    blocks.schedule(_output(new=_wave("a", batch, num_blocks, 0, 0)), first.get,
                    lambda slot: positions + 5, pool, tokens)
    started = time.perf_counter()
    blocks.schedule(_output(finished=list(first)), first.get, lambda slot: positions + 5,
                    pool, tokens)
    saved = time.perf_counter() - started
    second = {f"b{i}": batch + i for i in range(batch)}
    blocks.schedule(_output(new=_wave("b", batch, num_blocks, positions, 1)), second.get,
                    lambda slot: 0, pool, tokens)
    started = time.perf_counter()
    adopted = blocks.adopt_all([(req_id, slot, positions) for req_id, slot in second.items()],
                               pool, tokens[batch:, positions])
    return saved, time.perf_counter() - started, int(adopted.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=12, help="blocks of each request")
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = [one_round(args) for _ in range(args.repeats + 1)][1:]  # the first warms up
    saves, adopts = ([r[i] * 1e3 for r in rounds] for i in (0, 1))
    print(f"batch {args.batch}, {args.blocks} blocks a request, {rounds[0][2]} hits adopted; "
          f"median [min-max] of {args.repeats}:")
    for name, ms in (("save (requests finish)", saves), ("adopt (prefix hits)", adopts)):
        print(f"  {name:<24} {statistics.median(ms):6.2f} ms [{min(ms):.2f}-{max(ms):.2f}]")


if __name__ == "__main__":
    main()
