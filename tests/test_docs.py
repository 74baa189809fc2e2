"""README.md and docs/ name only what exists: every file path they give (in `code` or a code
block, or a Markdown link) is in the repository, and every flag of a `bullet SUBCOMMAND` line
is in that command's `--help`; so a renamed or removed script, module or flag fails here."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from bulletserve.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Where a path in a doc may be written from: the repository, the package (and the model's C
# sources), the tests, the doc's folder.
BASES = (ROOT, ROOT / "src" / "bulletserve", ROOT / "src" / "bulletserve" / "model", ROOT / "tests")
PATH_SUFFIXES = (".py", ".sh", ".md", ".json", ".png", ".c", ".yaml", ".toml", ".txt")
# Paths outside this repository (the peers' files, the shared folder CI lays beside it).
OUTSIDE = ("../shared/",)

_CODE = re.compile(r"`([^`\n]+)`")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# A flag whose value is a file a command writes, or the command's own arguments to compare.
_OUTPUT = re.compile(r"^(>|-o|--[\w-]*(?:output|out|plot|results|dir)[\w-]*)$")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _code_texts(text: str) -> list[str]:
    """Inline code spans and fenced blocks' lines (a `\\`-continued line joined)."""
    blocks = [m.group(0) for m in _FENCE.finditer(text)]
    prose = _FENCE.sub("", text)
    lines = [m.group(1) for m in _CODE.finditer(prose)]
    for block in blocks:
        lines += block.replace("\\\n", " ").splitlines()[1:-1]
    return lines


def _named_paths(text: str) -> set[str]:
    """Words that are repository paths: a folder and a file of a known kind, no placeholder."""
    paths = set()
    for line in _code_texts(text):
        words = line.replace("=", " ").split()
        for before, word in zip(["", *words][: len(words)], words, strict=True):
            word = word.strip("'\",;()")
            if (
                not _OUTPUT.match(before)
                and "/" in word
                and word.endswith(PATH_SUFFIXES)
                and not re.search(r"[<>*{}$:]", word)
                and not word.startswith(("http", "~", "/"))
            ):
                paths.add(word)
    return paths


def _exists(path: str, doc: Path) -> bool:
    """Whether the path is there; a path whose top folder is none of ours (`results/run.json`)
    is a user's own file, not the repository's."""
    if path.startswith(OUTSIDE):
        return True  # checked where it lives
    bases = (*BASES, doc.parent)
    top = path.removeprefix("./").split("/")[0]
    if top != ".." and not any((base / top).is_dir() for base in bases):
        return True
    return any((base / path).exists() for base in bases)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc):
    text = doc.read_text()
    missing = sorted(p for p in _named_paths(text) if not _exists(p, doc))
    links = [m.group(1) for m in _LINK.finditer(text) if "://" not in m.group(1)]
    missing += sorted(link for link in links if not (doc.parent / link).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names what does not exist: {missing}"


def _subcommand_flags() -> dict[tuple[str, ...], set[str]]:
    """(`bullet` subcommand words) -> the option strings its --help lists."""
    flags: dict[tuple[str, ...], set[str]] = {}

    def walk(parser, words: tuple[str, ...]) -> None:
        options = set()
        for action in parser._actions:
            options.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*words, name))
        flags[words] = options

    walk(build_parser(), ())
    return flags


FLAGS = _subcommand_flags()


def _bullet_commands(text: str) -> list[list[str]]:
    """Each `bullet ...` command a doc gives, as its words (from `bullet` on)."""
    commands = []
    for line in _code_texts(text):
        for part in re.split(r"\s*(?:&&|\||;)\s*", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                words = part.split()
            for index, word in enumerate(words):
                if word.endswith("bullet") and word.split("/")[-1] == "bullet":
                    commands.append(words[index + 1 :])
                    break
    return commands


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_flag_of_a_bullet_command_in_a_doc_is_in_its_help(doc):
    unknown = []
    for words in _bullet_commands(doc.read_text()):
        command: tuple[str, ...] = ()
        for word in words:
            if (*command, word) in FLAGS:
                command = (*command, word)
            elif not word.startswith("-"):
                if word in ("...", "…"):
                    break
                continue
        if command == ():
            continue
        for word in words:
            flag = word.split("=")[0]
            if flag.startswith("--") and flag != "--" and flag not in FLAGS[command]:
                unknown.append(f"bullet {' '.join(command)} {flag}")
    where = doc.relative_to(ROOT)
    assert not unknown, f"{where} gives flags no command has: {sorted(set(unknown))}"
