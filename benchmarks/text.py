"""Throughput of text preparation: ``dasktrain.prepare`` of a corpus into a token dataset,
on Dask, against a plain single-process loop doing the same tokenisation and packing.

What it measures
----------------
Tokens/s of turning the Python standard library's own ``.py`` sources (every one below
``sysconfig.get_paths()["stdlib"]`` but ``site-packages``, read as UTF-8: all but a handful
of test files written in other encodings on purpose; ~31 MB) into packed
(input, next-token target) pairs of ``seq_len`` tokens, two ways:

* **dask**: ``dasktrain.prepare(corpus, out, text_glob="*.py", ...)`` with its default
  settings otherwise (``seq_len`` 1024, zstd level 3 with checksums, 4 MiB chunks, the
  statistics and chunk record ``verify`` checks, the atomic publish), on the LocalCluster
  ``dasktrain prepare`` starts (``--workers`` single-threaded worker processes). The
  cluster is started once, before any timing; start-up is not measured (one run of the
  command from the shell, start-up included, is reported beside).
* **baseline**: what a user would otherwise write, one process: walk the corpus in the
  same order, read each file, tokenise it, append the end-of-text id, concatenate, cut the
  stream into the same (input, target) rows and ``np.save`` them (``x.npy`` and ``y.npy``,
  uncompressed). The outputs are compared value for value. A third row runs the same
  loop (byte tokenizer) writing what ``prepare`` stores instead: the same Zarr arrays,
  chunks and codec, so that one ratio compares the same output on both sides.

Two tokenizers, each a row: the byte tokenizer (the default; tokenising is reading, so
this row measures reading, packing, compressing and writing) and a byte-level BPE
``tokenizer.json`` (vocabulary 4,096) trained here, before any timing, on the first 2 MB
of the corpus (tokenising costs real CPU: the work the cluster spreads). Tokens/s counts
the tokens of the stream over the wall time of one run; each cell is the median of
``--repeats`` runs, interleaved, after one unmeasured warm-up run of each (page cache,
imports on the workers). The corpus is copied once into a temporary directory (untimed),
removed at exit.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/text.py                 # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/text.py --max-mb 8 --repeats 5
    .venv/bin/python benchmarks/text.py --quick         # seconds: rough figures (1 MB)
"""

from __future__ import annotations

import os

# Before numpy is imported here and before the worker processes start (they inherit it).
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import platform
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zarr
from distributed import Client

import dasktrain
from dasktrain._cluster import start_local_cluster
from dasktrain.cli.bench import (
    Ratio,
    interleaved_medians,
    parse_with_quick,
    ratio_of,
    write_ratios,
)
from dasktrain.datasets.format import chunk_rows_for

EOT = "<|endoftext|>"
QUICK = {"max_mb": 1.0, "repeats": 1, "shell": False}
GOAL = "≥ 1.5x"


def copy_corpus(target: Path, max_mb: float) -> tuple[int, int]:
    """Copy the standard library's UTF-8 ``.py`` files (sorted by path, at most ``max_mb``
    MB of them; 0: all) into ``target``; returns (files, bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = []
    for directory, subdirectories, files in os.walk(root):
        if Path(directory) == root:
            subdirectories[:] = [d for d in subdirectories if d != "site-packages"]
        names += [Path(directory, f).relative_to(root).as_posix() for f in files
                  if f.endswith(".py")]
    copied = size = 0
    for name in sorted(names):
        data = (root / name).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a test file in another encoding on purpose; a BPE needs UTF-8
        if max_mb and size + len(data) > max_mb * 1e6:
            break
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(data)
        copied, size = copied + 1, size + len(data)
    return copied, size


def corpus_files(root: Path) -> list[Path]:
    """The corpus's files in the order a token dataset takes them (relative path)."""
    return sorted((p for p in root.rglob("*.py") if p.is_file()),
                  key=lambda p: p.relative_to(root).as_posix())


def train_bpe(root: Path, path: Path) -> Path:
    """A byte-level BPE tokenizer.json of 4,096 tokens, trained on the corpus's first 2 MB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    for file in corpus_files(root):
        texts.append(file.read_text(encoding="utf-8"))
        size += len(texts[-1])
        if size > 2e6:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=4096, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))
    return path


def baseline_stream(root: Path, tokenizer_json: Path | None) -> np.ndarray:
    """The plain loop's token stream: each file's tokens, then the end-of-text id."""
    if tokenizer_json is None:
        def encode(data: bytes) -> np.ndarray:
            return np.frombuffer(data, np.uint8)
        eot, dtype = 256, np.uint16
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_json))

        def encode(data: bytes) -> np.ndarray:
            return np.asarray(tokenizer.encode(data.decode("utf-8"),
                                               add_special_tokens=False).ids)
        eot, dtype = tokenizer.token_to_id(EOT), np.uint16
    parts = []
    for file in corpus_files(root):
        data = file.read_bytes()
        if data:
            parts.append(encode(data).astype(dtype))
            parts.append(np.array([eot], dtype))
    return np.concatenate(parts)


def baseline(root: Path, out: Path, seq_len: int, tokenizer_json: Path | None) -> int:
    """The plain loop: tokenise, pack, ``np.save``; returns the tokens of the stream."""
    stream = baseline_stream(root, tokenizer_json)
    rows = (len(stream) - 1) // seq_len
    np.save(out / "x.npy", stream[: rows * seq_len].reshape(rows, seq_len))
    np.save(out / "y.npy", stream[1 : rows * seq_len + 1].reshape(rows, seq_len))
    return len(stream)


def baseline_zarr(root: Path, out: Path, seq_len: int) -> int:
    """The plain loop (byte tokenizer) writing what ``prepare`` stores instead of ``.npy``
    files: the same Zarr arrays, chunks and codec (zstd level 3, checksummed)."""
    stream = baseline_stream(root, None)
    rows = (len(stream) - 1) // seq_len
    chunk_rows = min(rows, chunk_rows_for(2 * seq_len * stream.itemsize))
    group = zarr.open_group(str(out), mode="w")
    for name, first in (("x", 0), ("y", 1)):
        array = group.create_array(name, shape=(rows, seq_len), chunks=(chunk_rows, seq_len),
                                   dtype=stream.dtype,
                                   compressors=zarr.codecs.ZstdCodec(level=3, checksum=True))
        array[:] = stream[first : first + rows * seq_len].reshape(rows, seq_len)
    return len(stream)


def check_same(baseline_out: Path, dask_out: Path) -> None:
    """The token dataset must hold exactly the baseline's rows."""
    ours = zarr.open_group(str(dask_out), mode="r")
    for name in ("x", "y"):
        want = np.load(baseline_out / f"{name}.npy")
        got = ours[name][:]
        if got.shape != want.shape or not np.array_equal(got, want):
            raise AssertionError(f"{name}: the token dataset differs from the baseline's "
                                 f"{want.shape} rows (got {got.shape})")




def shell_run(corpus: Path, out: Path) -> float:
    """Seconds of one ``dasktrain prepare`` from the shell (its LocalCluster: one worker
    process per core): imports, cluster start-up, the preparation, closing the cluster."""
    script = Path(sys.executable).parent / "dasktrain"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "dasktrain.cli"]
    start = time.perf_counter()
    subprocess.run([*command, "prepare", str(corpus), str(out), "--text-glob", "*.py",
                    "--overwrite", "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-mb", type=float, default=0.0,
                        help="use the first MB of the corpus only (default 0: all of it)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="Dask workers (default 2)")
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="tokens per sequence (default 1024, prepare's default)")
    parser.add_argument("--no-bpe", action="store_true", help="the byte tokenizer's row only")
    parser.add_argument("--no-shell", dest="shell", action="store_false",
                        help="skip the run of `dasktrain prepare` from the shell")
    args = parse_with_quick(parser, argv, QUICK,
                            f"seconds: the first {QUICK['max_mb']:g} MB, one timed run, "
                            "no shell run")
    for flag in ("repeats", "workers", "seq_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.max_mb < 0:
        parser.error("--max-mb must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wall = time.perf_counter()
    report = sys.stderr if args.ratios_json else sys.stdout
    failed: dict[str, str] = {}
    kinds = {"bytes": "byte tokenizer (default)"}
    if not args.no_bpe:
        kinds["bpe"] = "BPE tokenizer.json, 4,096 tokens"
    with tempfile.TemporaryDirectory(prefix="dasktrain-bench-") as tmp:
        root = Path(tmp)
        corpus = root / "corpus"
        corpus.mkdir()
        files, size = copy_corpus(corpus, args.max_mb)
        tokenizers = {"bytes": None}
        if "bpe" in kinds:
            tokenizers["bpe"] = train_bpe(corpus, root / "tokenizer.json")
        tokens: dict[str, int] = {}

        def base(kind: str) -> Callable[[], object]:
            out = root / f"base-{kind}"
            out.mkdir()

            def run() -> None:
                tokens[kind] = baseline(corpus, out, args.seq_len, tokenizers[kind])
            return run

        def dask(client: Client, kind: str) -> Callable[[], object]:
            options = {} if tokenizers[kind] is None else {"tokenizer": str(tokenizers[kind])}
            return lambda: dasktrain.prepare(
                corpus, root / f"dask-{kind}.zarr", client=client, progress=False,
                overwrite=True, text_glob="*.py", seq_len=args.seq_len, **options)

        with start_local_cluster(args.workers) as cluster, Client(cluster) as client:
            client.wait_for_workers(args.workers)
            runs: dict[str, Callable[[], object]] = {}
            for kind in kinds:
                runs[f"base-{kind}"] = base(kind)
                runs[f"dask-{kind}"] = dask(client, kind)
            runs["basezarr-bytes"] = lambda: baseline_zarr(corpus, root / "base-zarr.zarr",
                                                           args.seq_len)
            med = interleaved_medians(runs, args.repeats, failed)
        for kind in kinds:
            if f"dask-{kind}" not in failed:
                check_same(root / f"base-{kind}", root / f"dask-{kind}.zarr")
        shell = shell_run(corpus, root / "shell.zarr") if args.shell else None

    rate = {name: tokens[name.split("-", 1)[1]] / t for name, t in med.items()}
    zarr_base = f"{rate['basezarr-bytes'] / 1e6:.2f} M ({med['basezarr-bytes']:.2f} s)"
    print(f"text preparation: {files:,} .py files of the standard library, {size / 1e6:.1f} "
          f"MB; seq_len {args.seq_len}; median of {args.repeats} run(s)", file=report)
    print(f"dask: {args.workers} worker process(es) x 1 thread (start-up not timed); "
          f"baseline: 1 process; {os.cpu_count()} CPU(s), load average "
          f"{os.getloadavg()[0]:.1f} at the end, Python {platform.python_version()}, zarr "
          f"{zarr.__version__}, numpy {np.__version__}", file=report)
    print(file=report)
    print("| tokenizer | tokens | dask tokens/s | baseline tokens/s | dask / baseline |",
          file=report)
    print("|---|---:|---:|---:|---:|", file=report)
    ratios = []
    for kind, label in kinds.items():
        name, base_name = f"dask-{kind}", f"base-{kind}"
        base_text = f"{rate[base_name] / 1e6:.2f} M ({med[base_name]:.2f} s)"
        if name in failed:
            print(f"| {label} | {tokens[kind]:,} | FAILED: {failed[name]} | {base_text} | - |",
                  file=report)
            continue
        ratio = ratio_of(rate[name], rate[base_name])
        print(f"| {label} | {tokens[kind]:,} | {rate[name] / 1e6:.2f} M ({med[name]:.2f} s) "
              f"| {base_text} | {ratio:.2f}x |", file=report)
        ratios.append(Ratio(
            workload=f"text prepare tokens/s, stdlib .py, {label}",
            ours=f"{rate[name] / 1e6:.2f} M", baseline=f"{rate[base_name] / 1e6:.2f} M "
            "(plain loop, one process, .npy)", ratio=ratio,
            # The byte tokenizer's goal is against the loop writing the same output (below):
            # its .npy loop writes 126 MB uncompressed, unchecked, with no statistics.
            goal=GOAL if kind != "bytes" else "—"))
    if "dask-bytes" not in failed:
        ratio = ratio_of(rate["dask-bytes"], rate["basezarr-bytes"])
        print(f"| byte tokenizer, baseline writing the same Zarr arrays (zstd-3) | "
              f"{tokens['bytes']:,} | {rate['dask-bytes'] / 1e6:.2f} M | {zarr_base} | "
              f"{ratio:.2f}x |", file=report)
        ratios.append(Ratio(
            workload="text prepare tokens/s, stdlib .py, byte tokenizer, same Zarr output",
            ours=f"{rate['dask-bytes'] / 1e6:.2f} M",
            baseline=f"{rate['basezarr-bytes'] / 1e6:.2f} M (plain loop, one process, zarr)",
            ratio=ratio, goal=GOAL))
    print(file=report)
    if shell is not None:
        print(f"`dasktrain prepare CORPUS OUT --text-glob '*.py'` from the shell, byte "
              f"tokenizer: {shell:.1f} s, imports and cluster start-up "
              f"({min(os.cpu_count() or 1, 8)} workers, one per core) included", file=report)
    print(f"command: {shlex.join(sys.orig_argv)}", file=report)
    print(f"total wall time: {time.perf_counter() - wall:.1f} s (incl. copying the corpus, "
          f"training the BPE, cluster start-up, warm-up)", file=report)
    if args.ratios_json:
        write_ratios(args.ratios_json, ratios)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
