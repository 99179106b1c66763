"""Our head runtime alone (no engine) on an 8B-shaped EAGLE-3 head with random
weights: the drafting costs of the tree cost model (issue 15). Called by
`bench_tree_cuda.py costs --parts head`; runs on CPU too (slowly), which is
how it is smoke-checked without a GPU.
"""
from __future__ import annotations

import time
from pathlib import Path

HEAD_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256,
               draft_vocab_size=32000, target_hidden_size=4096, aux_layer_ids=[2, 16, 29],
               rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
BATCH_SIZES = (1, 16, 64)
MS = 1000.0


HEAD_CONTEXT = 512  # cached positions per request before drafting
HEAD_CONFIGS = [(1, k, k + 1) for k in range(1, 9)] + [(4, 4, 8), (4, 4, 16), (4, 8, 32),
                                                         (8, 8, 64)]  # topk, steps, nodes


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, repeats: int = 20) -> float:
    fn()
    _sync()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync()
    return (time.perf_counter() - started) / repeats


def head_steps(head_dir: Path, config: dict = HEAD_8B, batch_sizes=BATCH_SIZES,
               context_len: int = HEAD_CONTEXT, dtype: str | None = None,
               attention_backend: str = "auto") -> list[dict]:
    """Our head runtime on the 8B-shaped random head, no engine: ingest of one
    verified position per request, one expansion step at width k (eager), and
    a whole drafting pass eager and as the runtime replays it on CUDA (one
    captured graph per pass), at batch 1/16/64. dtype: the head's (default
    bfloat16 on CUDA, as `draft_dtype="auto"` with a bf16 target; float32 on
    CPU). attention_backend: the runtime's attention over its cache
    (`proposers/head_attention.py`: `auto`, `torch` or `triton`)."""
    import torch

    from vllm_specplug.proposers.draft_layers import cast_parameters
    from vllm_specplug.proposers.eagle3_head import HeadRuntime
    from vllm_specplug.proposers.eagle3_loading import load_head

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    head = cast_parameters(load_head(head_dir).to(device), getattr(torch, dtype))
    embed = torch.nn.Embedding(config["vocab_size"], config["hidden_size"]).to(device)
    embed = embed.to(torch.bfloat16) if device == "cuda" else embed
    eager = HeadRuntime(head, embed, num_slots=max(batch_sizes),
                        attention_backend=attention_backend)
    graphed = HeadRuntime(head, embed, num_slots=max(batch_sizes), cuda_graphs=device == "cuda",
                          attention_backend=attention_backend)
    aux = len(config["aux_layer_ids"]) * config["target_hidden_size"]
    rows = []
    for batch in batch_sizes:
        ids = [f"r{b}" for b in range(batch)]
        context = torch.arange(context_len, device=device)
        inputs = (torch.randn(batch * context_len, aux, device=device),
                  torch.randint(0, min(1000, config["vocab_size"]), (batch * context_len,),
                                device=device),
                  context.repeat(batch), [context_len] * batch)
        for runtime in (eager, graphed):
            runtime.ingest_many(ids, *inputs)
        one = torch.full((batch,), context_len, device=device)
        step_inputs = (torch.randn(batch, aux, device=device), one,
                       torch.full((batch,), context_len), [1] * batch)  # positions on the host
        ingest = _timed(lambda: eager.ingest_many(ids, *step_inputs))
        ingest_graph = (_timed(lambda: graphed.ingest_many(ids, *step_inputs))
                        if graphed.graphs is not None else None)
        roots = torch.zeros(batch, dtype=torch.long, device=device)
        slots = torch.tensor([eager.pool.slot_of[r] for r in ids], device=device)
        pool = eager.pool
        ctx = eager._context(slots, context_len + 1)
        position = one + 1
        rope = eager.layer.rope(position)
        for topk, steps, nodes in HEAD_CONFIGS:
            beam = torch.zeros(batch, topk, dtype=torch.long, device=device)
            parent = pool.last_out.new_zeros(batch, topk, config["hidden_size"])
            path = (pool.keys.new_zeros(batch, topk, config["num_key_value_heads"], 1,
                                        config["head_dim"]),) * 2
            expand = lambda: eager._expand(ctx, beam, parent, path, position, rope)  # noqa: E731
            draft = lambda rt: lambda: rt.draft_trees(  # noqa: E731
                ids, roots, one + 1, topk, steps, nodes)
            rows.append({"dtype": dtype, "attention": attention_backend, "batch_size": batch, "topk": topk, "num_steps": steps,
                         "num_nodes": nodes, "ingest_s": ingest, "ingest_graph_s": ingest_graph,
                         "step_eager_s": _timed(expand),
                         "draft_s": _timed(draft(eager), 5),
                         "draft_graph_s": (_timed(draft(graphed), 20)
                                           if graphed.graphs is not None else None)})
            r = rows[-1]
            print(f"  head {dtype} batch {batch} topk {topk} steps {steps}: ingest "
                  f"{MS * ingest:.2f} ms eager / {MS * (ingest_graph or float('nan')):.2f} "
                  f"ms graphed, step {MS * r['step_eager_s']:.2f} ms eager, pass "
                  f"{MS * r['draft_s']:.2f} ms eager / "
                  f"{MS * (r['draft_graph_s'] or float('nan')):.2f} ms graphed", flush=True)
        for req_id in ids:
            eager.forget(req_id)
            graphed.forget(req_id)
    return rows
