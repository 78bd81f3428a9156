"""The code blocks of ``docs/``: each says what it is, and what can be checked without a
cluster, a bucket or minutes of work is checked as written: Python compiles, every
``dasktrain`` command line parses with the command's own parser and names files that
exist, every benchmark or example script named is there, and a TOML config holds only keys
that ``dasktrain train`` takes."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
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


# -- Python blocks, run -------------------------------------------------------------------
# What the prose around a page's blocks introduces (a model, a loss, a dataset) and the
# files its blocks read, written before the page's blocks run one after the other, in one
# process of their own (as a reader's session would), in an empty directory. A block
# that cannot run here says why in a comment just above it (``<!-- not run: ... -->``):
# a remote cluster, a bucket, a sketch.
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*$")

COMMON = """\
from pathlib import Path

import numpy as np
import torch
torch.set_num_threads(1)
import dasktrain as dt
from PIL import Image

def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

loss = torch.nn.functional.cross_entropy
opt = dt.optim.sgd(0.05, momentum=0.9)

def digits():
    return dt.prepare("digits", "data/digits.zarr", split="train=0.8,val=0.2", normalize=True,
                      overwrite=True, progress=False)

def scans(rows=96):
    rng = np.random.default_rng(0)
    np.savez("scans.npz", image=rng.random((rows, 1, 8, 8), dtype=np.float32),
             metadata=rng.random((rows, 3), dtype=np.float32),
             label=rng.integers(0, 10, rows))

def photos(folder, per_class=6):
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (Path(folder) / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (72, 80, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(Path(folder) / name / f"{i}.png")

class ImageAndMetadata(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.image, self.meta = torch.nn.Linear(64, 16), torch.nn.Linear(3, 16)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, image, metadata):
        return self.head(torch.relu(self.image(image.flatten(1)) + self.meta(metadata)))

    def aux_loss(self):
        return self.head.weight.pow(2).mean()
"""

# Run just before block i of a page (its index among the page's Python blocks).
BEFORE = {
    ("datasets.md", 1): "scans()",
    ("datasets.md", 2): "Path('books/b').mkdir(parents=True)\n"
                        "for i in range(6):\n"
                        "    Path(f'books/b/{i}.txt').write_text('A line of a book. ' * 90)",
    ("datasets.md", 3): "photos('train')",
    ("elastic.md", 0): "ds = digits()",
    ("elastic.md", 1): "data, client = ds.split('train'), dt.get_client()",
    ("evolve.md", 1): "ds = digits()\n"
                      "def make_mlp():\n"
                      "    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), "
                      "torch.nn.Linear(32, 10))\n"
                      "def accuracy(output, target):\n"
                      "    return (output.argmax(1) == target).float().mean()",
    ("modes.md", 0): "",
    ("pipeline.md", 0): "digits()",
    ("pipeline.md", 1): "scans()\nds = dt.prepare('scans.npz', 'data/scans.zarr', "
                        "arrays=['image', 'metadata', 'label'], split='train=0.8,val=0.2', "
                        "progress=False)\nmodel = ImageAndMetadata()",
    ("pipeline.md", 2): "loss = torch.nn.functional.cross_entropy\n"
                        "photos('photos', per_class=96)\n"
                        "ds = dt.prepare('photos', 'data/photos.zarr', "
                        "image_size=72, split='train=0.75,val=0.25', progress=False)\n"
                        "def convnet():\n"
                        "    torch.manual_seed(0)\n"
                        "    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=4), "
                        "torch.nn.Flatten(), torch.nn.Linear(4 * 16 * 16, 2))",
    ("trainer.md", 0): "digits()",
    ("trainer.md", 1): "scans(rows=160)\n"
                       "ds = dt.prepare('scans.npz', 'data/named.zarr', arrays=["
                       "'image', 'meta=metadata', 'label'], "
                       "split='train=0.6,val=0.2,test=0.2', progress=False)\n"
                       "train, val, test = ds.split('train'), ds.split('val'), ds.split('test')\n"
                       "class make_model(torch.nn.Module):\n"
                       "    def __init__(self):\n"
                       "        super().__init__()\n"
                       "        self.backbone = torch.nn.Linear(64, 16)\n"
                       "        self.meta, self.head = torch.nn.Linear(3, 16), "
                       "torch.nn.Linear(16, 10)\n"
                       "    def forward(self, image, meta):\n"
                       "        return self.head(torch.relu(self.backbone(image.flatten(1)) "
                       "+ self.meta(meta)))\n"
                       "    def aux_loss(self):\n"
                       "        return self.head.weight.pow(2).mean()\n"
                       "def top1(output, target):\n"
                       "    return (output.argmax(1) == target).float().mean()",
    ("trainer.md", 3): "ds = digits()\ntrain, val = ds.split('train'), ds.split('val')\n"
                       "trainer = dt.Trainer(net, loss, opt, workers=2, batch_size=32, "
                       "progress=False)\nother = dt.History()",
}


RUNNER = """\
import json
if __name__ == "__main__":  # worker processes import the main module: it must not run again
    namespace = {"__name__": "__main__"}
    for name, code in json.load(open("blocks.json")):
        print("--", name, flush=True)
        exec(compile(code, name, "exec"), namespace)
"""


def _page_blocks(page: str) -> list[tuple[str, str]]:
    """``page``'s Python blocks to run, each after its setup, as (name, code)."""
    lines = (ROOT / "docs" / page).read_text(encoding="utf-8").split("\n")
    found = [("setup", COMMON)]
    own = [b for b in BLOCKS if b.page == page and b.language == "python"]
    for index, block in enumerate(own):
        above = lines[block.line - 2] if block.line >= 2 else ""
        if NOT_RUN.search(above):
            continue
        if (page, index) in BEFORE:
            found.append((f"setup of {block}", BEFORE[page, index]))
        found.append((str(block), block.text))
    return found if len(found) > 1 else []


PAGES = sorted({b.page for b in BLOCKS if b.language == "python"})
RUN = [page for page in PAGES if _page_blocks(page)]  # the others' blocks all say why not


def test_a_block_left_out_says_why():
    for page in PAGES:
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        for marker in re.findall(r"<!-- not run:(.*?)-->", text):
            assert len(marker.strip()) > 10, (page, marker)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", RUN)
def test_a_pages_python_blocks_run_as_written(page, tmp_path):
    blocks = _page_blocks(page)
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "page.py").write_text(RUNNER)
    result = subprocess.run([sys.executable, "page.py"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=280,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
