"""A tiny language model of the Python standard library's own source code.

The corpus exists on every machine with Python, so nothing is downloaded: the ``.py`` files
below ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` left out, ~30 MB). The script

1. prepares them into a token dataset with the byte-level tokenizer (tokenised and packed
   into sequences of ``--seq-len`` bytes on a LocalCluster, split 95/5 into train and val);
   ``--max-mb`` takes only the first MB of the files (sorted by path), for speed;
2. trains a small causal transformer with ``dt.Trainer`` (``sync``, AdamW, ``--workers``
   replicas, one CPU thread each) for ``--epochs`` epochs;
3. prints the validation loss, in nats per byte and bits per byte, and a sample the model
   writes after ``--prompt``.

Run::

    .venv/bin/python examples/tiny_lm.py                       # minutes: docs/examples.md
    .venv/bin/python examples/tiny_lm.py --max-mb 0 --epochs 1  # the whole library: longer
    .venv/bin/python examples/tiny_lm.py --max-mb 0.05 --seq-len 32 --d-model 32 \\
        --layers 1 --epochs 1                                   # seconds: a smoke test

The same preparation from the shell::

    dasktrain prepare "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \\
        data/stdlib.zarr --text-glob '*.py,!site-packages/*' --seq-len 256 \\
        --split train=0.95,val=0.05
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from distributed import Client

import dasktrain as dt
from dasktrain._cluster import start_local_cluster
from dasktrain.datasets.tokenizers import load_tokenizer


class TinyLM(torch.nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm transformer blocks
    with a causal mask, and a linear head to the next token's logits."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int = 128, layers: int = 2,
                 heads: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab_size, d_model)
        self.position = torch.nn.Parameter(0.02 * torch.randn(seq_len, d_model))
        block = torch.nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                                 activation="gelu", batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Tokens arrive as stored, uint16: embeddings take int64 ids. (batch, L) -> (batch,
        # L, vocab).
        length = tokens.shape[1]
        hidden = self.embed(tokens.long()) + self.position[:length]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(length)
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every position's next token (nats per token)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.long().flatten())


def stdlib_corpus(out: Path, max_mb: float) -> tuple[Path, str]:
    """The corpus to prepare and the patterns choosing its files: the standard library in
    place, or a copy of its first ``max_mb`` MB of ``.py`` files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not max_mb:
        return stdlib, "*.py,!site-packages/*"
    corpus = out / "corpus"
    shutil.rmtree(corpus, ignore_errors=True)
    names = []
    for directory, subdirectories, files in os.walk(stdlib):
        if Path(directory) == stdlib:
            subdirectories[:] = [d for d in subdirectories if d != "site-packages"]
        names += [Path(directory, f).relative_to(stdlib) for f in files if f.endswith(".py")]
    size = 0
    for name in sorted(names, key=lambda p: p.as_posix()):
        length = (stdlib / name).stat().st_size
        if size + length > max_mb * 1e6:
            if size:
                break
            continue  # a first file larger than the cap: look for one that fits
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(stdlib / name, corpus / name)
        size += length
    return corpus, "*.py"


@torch.no_grad()
def generate(model: TinyLM, prompt: np.ndarray, tokens: int, seq_len: int,
             temperature: float = 0.8, seed: int = 0) -> np.ndarray:
    """Sample ``tokens`` ids after ``prompt``, each from the model's next-token
    distribution over the last ``seq_len`` ids."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(prompt.astype(np.int64))[None]
    for _ in range(tokens):
        logits = model(ids[:, -seq_len:])[0, -1] / temperature
        following = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        ids = torch.cat([ids, following[None]], dim=1)
    return ids[0].numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/tiny_lm", help="corpus copy and dataset")
    parser.add_argument("--max-mb", type=float, default=1.5,
                        help="first MB of the library's .py files (0: all of it; default 1.5)")
    parser.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--sample", type=int, default=300, help="bytes to generate")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    if args.d_model % args.heads:
        parser.error("--d-model must be a multiple of --heads")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus, glob = stdlib_corpus(out, args.max_mb)
    progress = not args.no_progress

    with start_local_cluster(args.workers) as cluster, Client(cluster) as client:
        start = time.perf_counter()
        ds = dt.prepare(corpus, out / "stdlib.zarr", client=client, text_glob=glob,
                        seq_len=args.seq_len, split="train=0.95,val=0.05", overwrite=True,
                        progress=progress)
        text = ds.attrs["text"]
        print(f"prepared {text['documents']:,} files, {text['tokens']:,} byte tokens into "
              f"{len(ds):,} sequences of {args.seq_len} in {time.perf_counter() - start:.1f} s "
              f"(train {len(ds.split('train')):,}, val {len(ds.split('val')):,})")

        model = functools.partial(TinyLM, text["tokenizer"]["vocab_size"], args.seq_len,
                                  args.d_model, args.layers, args.heads)
        trainer = dt.Trainer(model, next_token_loss, dt.optim.adamw(args.lr),
                             mode="sync", workers=args.workers, batch_size=args.batch_size,
                             progress=progress)
        print(f"model: {sum(p.numel() for p in trainer.model.parameters()):,} parameters; "
              f"{args.workers} workers x {args.batch_size} sequences per step")
        history = trainer.fit(ds.split("train"), epochs=args.epochs,
                              validation=ds.split("val"), client=client)
        for k, epoch in enumerate(history.epochs):
            loss = epoch["validation"]["loss"]
            print(f"epoch {k}: validation loss {loss:.3f} nats/byte = "
                  f"{loss / math.log(2):.3f} bits per byte")
        summary = history.summary()
        print(f"trained {summary['updates']} updates in {summary['wall_time_s']:.0f} s, "
              f"{summary['samples_per_s'] * args.seq_len:,.0f} tokens/s")

    tokenizer = load_tokenizer(ds)
    prompt = tokenizer.encode(args.prompt.encode("utf-8"))
    sample = generate(trainer.model, prompt, args.sample, args.seq_len)
    print(f"sample after {args.prompt!r}:")
    print(tokenizer.decode(sample))


if __name__ == "__main__":
    main()
