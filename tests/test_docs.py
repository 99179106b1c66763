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


SPEC_START = re.compile(r"speculative_config=|--speculative-config '")
NAME_VALUE = re.compile(r'(:\s*)([A-Za-z_][A-Za-z0-9_]*)(\s*[,}])')  # "model": HEAD_DIR
VLLM_METHODS = {"ngram", "eagle3", "mtp", "suffix", "extract_hidden_states", "eagle",
                "medusa", "draft_model", "ngram_gpu"}


def _balanced(text: str, start: int) -> str:
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end + 1]
    raise AssertionError(f"unclosed speculative config at {text[start:start + 60]!r}")


def doc_spec_configs(text: str) -> list[dict]:
    """Every speculative config a doc's code writes (`speculative_config={...}`
    or `--speculative-config '{...}'`), placeholders (HEAD_DIR) as strings."""
    import ast

    configs = []
    for block in re.findall(r"```.*?```", text, re.S):
        for match in SPEC_START.finditer(block):
            start = block.index("{", match.end() - 1)
            literal = NAME_VALUE.sub(r'\1"\2"\3', _balanced(block, start))
            literal = re.sub(r"\btrue\b", "True", re.sub(r"\bfalse\b", "False", literal))
            configs.append(ast.literal_eval(literal))
    return configs


@pytest.mark.parametrize("doc", DOCS, ids=_doc_ids())
def test_every_speculative_config_in_the_docs_is_accepted(doc):
    """The configs the docs tell users to pass are ones our front end accepts
    (options, types, ranges), or one of vLLM's own methods: the part of a code
    block that can run without a model runs."""
    from vllm_specplug import registry
    from vllm_specplug.integration.config import translate

    for config in doc_spec_configs(doc.read_text()):
        method = config["method"]
        if method in VLLM_METHODS or method in ("my_method",):  # the guide's example plugin
            continue
        assert registry.is_registered(method), f"{doc.name}: unknown method {method!r}"
        assert translate(config) is not None, config


def test_the_config_reader_finds_a_bad_option():
    text = "```python\nLLM(m, speculative_config={\"method\": \"specplug_ngram\", " \
           "\"num_speculative_tokens\": 4, \"prompt_lookup_maxx\": 3})\n```"
    from vllm_specplug.integration.config import translate
    from vllm_specplug.proposers.base import ProposerConfigError

    (config,) = doc_spec_configs(text)
    with pytest.raises(ProposerConfigError, match="prompt_lookup_maxx"):
        translate(config)
