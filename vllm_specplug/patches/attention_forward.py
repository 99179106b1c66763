"""The shape every attention-backend patch of ours has: the backend's
`forward` runs unchanged, then a hook may rewrite rows of its output (tree
attention). Used by the patches of `cpu_attn`, `flash_attn` and `triton_attn`."""
from __future__ import annotations

from typing import Callable

Hook = Callable[..., None]  # hook(impl, layer, query, kv_cache, attn_metadata, output)


def followed_by(original, hook: Hook):
    """`forward` of a backend impl, followed by `hook` on its inputs and output."""
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                *args, **kwargs):
        result = original(self, layer, query, key, value, kv_cache, attn_metadata,
                          output, *args, **kwargs)
        hook(self, layer, query, kv_cache, attn_metadata, output)
        return result

    return forward
