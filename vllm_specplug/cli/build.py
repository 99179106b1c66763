"""`vllm-specplug build-model`: build (or find cached) a built-in model or
draft head (`tiny-eagle3`: an EAGLE-3 head for `tiny`, loaded by vLLM's
`eagle3`)."""
from __future__ import annotations

import json

from vllm_specplug.models.build import MODEL_SPECS, build_model, read_build_info
from vllm_specplug.models.heads import HEAD_SPECS, build_head


def add_parser(sub) -> None:
    parser = sub.add_parser("build-model", help="train a built-in model or draft "
                            "head on CPU (cached) and print its directory")
    parser.add_argument("name", nargs="?", default="tiny",
                        choices=sorted(MODEL_SPECS) + sorted(HEAD_SPECS))
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.name in HEAD_SPECS:
        model_dir = build_head(args.name)
    else:
        model_dir = build_model(args.name)
    print(json.dumps(read_build_info(model_dir), indent=2))
    print(model_dir)
    return 0
