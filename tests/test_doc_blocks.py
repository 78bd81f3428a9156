"""The code blocks of ``docs/``: each says what it is, and what can be checked without a
cluster, a bucket or minutes of work is checked as written: Python compiles, every
``dasktrain`` command line parses with the command's own parser and names files that
exist, every benchmark or example script named is there, and a TOML config holds only keys
that ``dasktrain train`` takes."""

from __future__ import annotations

import re
import shlex
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from dasktrain.cli.main import _build_parser
from dasktrain.cli.train_keys import config_keys

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
LANGUAGES = {"python", "bash", "toml", "text", "console"}
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass
class Block:
    page: str
    line: int
    language: str
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.language or 'no language'})"


def _blocks() -> list[Block]:
    found = []
    for page in DOCS:
        lines = page.read_text(encoding="utf-8").split("\n")
        opening: tuple[int, str, str] | None = None
        body: list[str] = []
        for number, line in enumerate(lines, 1):
            fence = FENCE.match(line)
            if opening is None and fence:
                opening, body = (number, fence.group(1), fence.group(2)), []
            elif opening is not None and fence and fence.group(1) == opening[1] \
                    and not fence.group(2):
                found.append(Block(page.name, opening[0], opening[2],
                                   textwrap.dedent("\n".join(body))))
                opening = None
            elif opening is not None:
                body.append(line)
        assert opening is None, f"{page.name}:{opening[0]}: a code block never closed"
    return found


BLOCKS = _blocks()


def _of(language: str) -> list[Block]:
    return [b for b in BLOCKS if b.language == language]


def test_every_code_block_says_what_it_is():
    assert len(BLOCKS) > 50
    unnamed = [str(b) for b in BLOCKS if b.language not in LANGUAGES]
    assert not unnamed, f"code blocks without one of {sorted(LANGUAGES)}: {unnamed}"


@pytest.mark.parametrize("block", _of("python"), ids=str)
def test_python_blocks_compile(block):
    compile(block.text, str(block), "exec")


def _commands(block: Block) -> list[list[str]]:
    """The block's command lines (continuations joined, comments and prompts left out),
    each split as the shell would (a command substitution stands for one word)."""
    text = re.sub(r"\\\n\s*", " ", block.text)
    text = re.sub(r'"\$\(.*?\)"', "WORD", text)
    commands = []
    for line in text.splitlines():
        line = line.strip().removeprefix("$ ")
        if line and not line.startswith("#"):
            commands.append(shlex.split(line, comments=True))
    return commands


SHELL = [b for b in BLOCKS if b.language in ("bash", "console")]


@pytest.mark.parametrize("block", SHELL, ids=str)
def test_every_dasktrain_command_parses_and_every_script_named_exists(block, capsys):
    parser = _build_parser()
    for words in _commands(block):
        program, *args = words
        if Path(program).name == "dasktrain":
            if "..." in args:  # a shape, not a command: its options are shown elsewhere
                continue
            try:
                parsed = parser.parse_args(args)
            except SystemExit as stop:  # --help exits 0; a bad option exits 2
                assert stop.code == 0, (str(block), words, capsys.readouterr().err)
                continue
            config = getattr(parsed, "config", None)
            if config is not None:  # `dasktrain train CONFIG`: the docs' configs exist
                assert (ROOT / config).exists(), (str(block), config)
        elif Path(program).name == "python" and args and args[0].endswith(".py"):
            assert (ROOT / args[0]).exists(), (str(block), args[0])
        elif program.startswith(("examples/", "benchmarks/")):
            assert (ROOT / program).exists(), (str(block), program)


@pytest.mark.parametrize("block", _of("toml"), ids=str)
def test_toml_blocks_hold_only_keys_dasktrain_train_takes(block):
    config = tomllib.loads(block.text)
    known = config_keys()
    for section, keys in config.items():
        assert section in known, (str(block), section)
        unknown = set(keys) - set(known[section])
        assert not unknown, (str(block), section, unknown)
