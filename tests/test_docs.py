"""The docs say only what is true: every file they link or name exists, every
`vllm-specplug` command they name exists, and every command's `--help` runs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_specplug.cli.main import main, make_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "docs" / "results").glob("*/README.md")),
        ROOT / "benchmarks" / "README.md"]
# Where a path written without its top folder is looked for, in this order.
BASES = ["", "vllm_specplug", "docs", "benchmarks", "benchmarks/gpu", "tests"]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CODE_PATH = re.compile(r"`([\w./-]+\.(?:py|sh|md|txt|json|png|toml))`")
COMMAND = re.compile(r"vllm-specplug ([a-z][a-z0-9-]+)")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)  # code blocks and inline code
NOT_COMMANDS = {"proposer"}  # "vllm-specplug proposer 'x' failed ...": quoted log lines
# OUT/..., HEAD/...: placeholders; .gpu/...: written by the staging scripts
PLACEHOLDER = re.compile(r"^(?:[A-Z_]+|\.gpu)/")


def _doc_ids():
    return [str(p.relative_to(ROOT)) for p in DOCS]


def _exists(name: str, doc: Path) -> bool:
    if (doc.parent / name).exists():
        return True
    return any((ROOT / base / name).exists() for base in BASES)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_ids())
def test_every_linked_file_exists(doc):
    text = doc.read_text()
    missing = [link for link in LINK.findall(text)
               if "://" not in link and not (doc.parent / link).exists()]
    assert missing == [], f"{doc.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_ids())
def test_every_named_file_exists(doc):
    names = {n for n in CODE_PATH.findall(doc.read_text())
             if "/" in n and not n.startswith(("$", "~", "/")) and "*" not in n
             and not PLACEHOLDER.match(n)}
    missing = sorted(n for n in names if not _exists(n, doc))
    assert missing == [], f"{doc.relative_to(ROOT)} names missing files: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_ids())
def test_every_named_command_exists(doc):
    named = {name for code in CODE.findall(doc.read_text()) for name in COMMAND.findall(code)}
    assert named - set(_commands()) - NOT_COMMANDS == set(), f"{doc.relative_to(ROOT)} names unknown commands"


def _commands() -> dict:
    return make_parser()._subparsers._group_actions[0].choices


def _nested(parser) -> list[list[str]]:
    """argv prefixes of a parser's sub-commands (bench offline, bench online)."""
    subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return [[name] for action in subs for name in action.choices]


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_command_help_runs(command, capsys):
    for argv in [[command], *([command, *n] for n in _nested(_commands()[command]))]:
        with pytest.raises(SystemExit) as done:
            main([*argv, "--help"])
        assert done.value.code == 0, argv
        assert "usage:" in capsys.readouterr().out
