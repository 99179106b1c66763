"""`vllm-specplug` command line: subcommands register themselves here."""
from __future__ import annotations

import argparse
import sys

from vllm_specplug.cli import bench, build, check, demo, extract, train_eagle3, train_mtp

SUBCOMMANDS = (bench, build, check, demo, extract, train_eagle3, train_mtp)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-specplug",
        description="Speculative-decoding toolkit for vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
