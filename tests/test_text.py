"""Token datasets: text corpora prepared on a real cluster into Zarr on disk, decoded back,
served by the pipeline as (input, next-token target) pairs; and every bad input refused by
name."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import dasktrain as dt
from dasktrain.datasets.sources.text_corpus import file_pieces, list_files
from dasktrain.datasets.sources.text_tokenize import read_part
from dasktrain.datasets.tokenizers import ByteTokenizer, load_tokenizer
from tests.common.builders import assert_user_error, run_cli_batch

EOT = "<|endoftext|>"


def _prepare(client, source, out, **options) -> dt.Dataset:
    ds = dt.prepare(source, out, client=client, progress=False, **options)
    report = dt.verify(ds, client=client, progress=False)
    assert report.ok, report.problems
    return ds


def _stream(ds: dt.Dataset) -> np.ndarray:
    """The token stream the rows hold: every input, then the last target's last token."""
    x, y = ds.x.compute(), ds.y.compute()
    return np.concatenate([x.ravel(), y[-1, -1:]]).astype(np.int64)


def _assert_shifted(x: np.ndarray, y: np.ndarray) -> None:
    """Targets are the inputs shifted by one token, across row boundaries too."""
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    np.testing.assert_array_equal(y[:-1, -1], x[1:, 0])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of text files: nested, non-ASCII, one empty, one of another suffix."""
    root = tmp_path_factory.mktemp("corpus")
    docs = {"a.txt": "hello world\nsecond line\n",
            "b.txt": "ünïcode ✓ text, no newline at the end",
            "sub/c.txt": "".join(f"line {i}: {'x' * (i % 13)}\n" for i in range(300)),
            "sub/empty.txt": "",
            "notes.md": "not chosen by the default patterns\n"}
    for name, text in docs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root, [docs[n] for n in ("a.txt", "b.txt", "sub/c.txt")]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A byte-level BPE tokenizer.json trained here on a tiny corpus: nothing downloaded."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, hello text", "line of text\n" * 5,
                             "ünïcode and more words"] * 20, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path, tok


def test_byte_tokens_round_trip_documents_joined_by_end_of_text(client, corpus, tmp_path):
    root, docs = corpus
    ds = _prepare(client, root, tmp_path / "tokens.zarr", seq_len=16, chunk_rows=40)
    text = ds.attrs["text"]
    want = np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8), 256) for d in docs])
    rows = (len(want) - 1) // 16
    assert len(ds) == rows and rows > 2 * 40  # several chunks, so several write tasks
    assert ds.attrs["arrays"]["x"] == {"role": "features", "dtype": "uint16",
                                       "shape": [rows, 16]}
    assert text["documents"] == 3 and text["empty_documents_skipped"] == 1
    assert text["tokens"] == len(want) and text["tokens_dropped"] == len(want) - 1 - rows * 16
    got = _stream(ds)
    np.testing.assert_array_equal(got, want[: len(got)])
    _assert_shifted(ds.x.compute(), ds.y.compute())
    # decode(tokens) is the source text, documents separated by the end-of-text token.
    tokenizer = load_tokenizer(ds)
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.decode(want) == EOT.join(docs) + EOT
    # What the rows hold is all of it but the dropped tail (a character cut there shows
    # as U+FFFD).
    assert (EOT.join(docs) + EOT).startswith(tokenizer.decode(got).rstrip("\ufffd"))
    # Its summary speaks of tokens, not of 257 "classes".
    summary = dt.describe(ds)
    assert (f"text      byte tokenizer (257 ids), {len(want):,} tokens of 3 documents in "
            "rows of 16: x inputs, y next-token targets") in summary
    assert "classes" not in summary
    # The statistics of the tokens are over all of them (a position is no feature), exact
    # (integer sums).
    for name in ("x", "y"):
        tokens = getattr(ds, name).compute().astype(np.float64)
        stats = ds.attrs["stats"][name]
        assert stats["pooled"] and stats["count"] == tokens.size
        assert stats["mean"] == pytest.approx([tokens.mean()], rel=1e-12)
        assert stats["std"] == pytest.approx([tokens.std()], rel=1e-10)
    assert "x: mean" in summary and "(all values)" in summary


def test_patterns_choose_files_and_leave_some_out(client, corpus, tmp_path):
    root, _ = corpus
    ds = _prepare(client, root, tmp_path / "md.zarr", seq_len=4, text_glob="*.md,*.txt,!sub/*")
    names = ["a.txt", "b.txt", "notes.md"]
    texts = [(root / n).read_text(encoding="utf-8") for n in names]
    want = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), 256) for t in texts])
    got = _stream(ds)
    np.testing.assert_array_equal(got, want[: len(got)])
    assert ds.attrs["provenance"]["source_details"]["glob"] == "*.md,*.txt,!sub/*"


def test_preparing_twice_gives_the_same_tokens(client, corpus, tmp_path):
    root, _ = corpus
    a = dt.prepare(root, tmp_path / "a.zarr", client=client, seq_len=8, chunk_rows=7,
                   progress=False)
    b = dt.prepare(root, tmp_path / "b.zarr", client=client, seq_len=8, chunk_rows=64,
                   progress=False)
    np.testing.assert_array_equal(a.x.compute(), b.x.compute())
    np.testing.assert_array_equal(a.y.compute(), b.y.compute())
    # Split: the same pairs, each in one split (grouped by split, order kept within).
    c = _prepare(client, root, tmp_path / "c.zarr", seq_len=8, chunk_rows=7,
                 split="train=0.8,val=0.2")
    assert sorted(c.splits) == ["train", "val"] and len(c) == len(a)
    pairs = sorted(row.tobytes() for row in np.concatenate([a.x.compute(), a.y.compute()], 1))
    split = [np.concatenate([c.split(s).x.compute(), c.split(s).y.compute()], 1)
             for s in ("train", "val")]
    assert sorted(row.tobytes() for part in split for row in part) == pairs


def test_a_large_file_is_cut_at_line_starts_and_read_whole(tmp_path):
    lines = [f"{i} {'word ' * (i % 7)}\n" for i in range(200)]
    (tmp_path / "big.txt").write_text("".join(lines) + "no newline at the end")
    (tmp_path / "small.txt").write_text("small\n")
    files, _ = list_files(tmp_path, None)
    pieces = file_pieces(files, piece_bytes=300, cut_bytes=100)
    assert len(pieces) > 10
    for file in files:
        parts = [p for piece in pieces for p in piece if p.file == file]
        read = [read_part(p) for p in parts]
        data = Path(file.path).read_bytes()
        assert b"".join(text for text, _ in read) == data
        for _, start in read:
            assert start == 0 or data[start - 1 : start] == b"\n"
        assert [p.ends_document for p in parts] == [False] * (len(parts) - 1) + [True]


def test_a_tokenizer_json_tokenises_files_and_table_columns(client, corpus, tokenizer_json,
                                                            tmp_path):
    path, tok = tokenizer_json
    eot = tok.token_to_id(EOT)
    root, docs = corpus
    cells = ["hello world, hello text", None, "", "line of text\nline of text", "NA",
             "ünïcode and more words"]
    table_docs = [c for c in cells if c]
    pd.DataFrame({"id": range(len(cells)), "body": cells}).to_parquet(
        tmp_path / "t.parquet", row_group_size=2)
    pd.DataFrame({"id": range(len(cells)), "body": cells}).to_csv(tmp_path / "t.csv",
                                                                  index=False)
    cases = [(root, docs, {}), (tmp_path / "t.parquet", table_docs, {"text_column": "body"}),
             (tmp_path / "t.csv", table_docs, {"text_column": "body"})]
    for k, (source, texts, options) in enumerate(cases):
        ds = _prepare(client, source, tmp_path / f"bpe{k}.zarr", tokenizer=str(path),
                      seq_len=5, chunk_rows=3, **options)
        want = np.concatenate([[*tok.encode(t).ids, eot] for t in texts])
        got = _stream(ds)
        np.testing.assert_array_equal(got, want[: len(got)])
        _assert_shifted(ds.x.compute(), ds.y.compute())
        assert ds.attrs["text"]["documents"] == len(texts)
        record = ds.attrs["text"]["tokenizer"]
        assert record["kind"] == "huggingface" and record["eot_id"] == eot
        decoder = load_tokenizer(ds)
        assert decoder.decode(want) == EOT.join(texts) + EOT
    assert ds.attrs["text"]["empty_documents_skipped"] == 2  # the missing cell and ""
    # A tokenizer.json that changed since is not the one the dataset was prepared with.
    changed = tmp_path / "changed.json"
    changed.write_text(path.read_text() + "\n")  # the same tokenizer, another file
    with pytest.raises(dt.DatasetError, match="is not the tokenizer"):
        load_tokenizer(ds, path=changed)


@pytest.fixture(scope="module")
def random_letters(client, tmp_path_factory):
    """A token dataset of random letters: every row differs from every other."""
    root = tmp_path_factory.mktemp("letters")
    rng = np.random.default_rng(0)
    for i in range(5):
        (root / f"{i}.txt").write_bytes(rng.integers(97, 123, 900, np.uint8).tobytes())
    return _prepare(client, root, root / "lm.zarr", seq_len=12, chunk_rows=50)


# "consumer": read in threads of this process; "anywhere": read and cut in Dask tasks on
# the worker processes, the batches sent back.
@pytest.mark.parametrize("placement", ["consumer", "anywhere"])
def test_pipeline_serves_shifted_pairs_exactly_once_and_resumes(client, random_letters,
                                                                placement):
    ds = random_letters
    x_all = ds.x.compute()
    common = {"batch_size": 32, "seed": 3, "shuffle": True, "block_rows": 25, "client": client,
              "placement": placement}
    batches = list(dt.Pipeline(ds, **common))
    x, y = (torch.cat(part).numpy() for part in zip(*batches, strict=True))
    assert batches[0][0].dtype == torch.uint16 and batches[0][0].shape == (32, 12)
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    rows = {row.tobytes(): i for i, row in enumerate(x_all)}
    order = [rows[row.tobytes()] for row in x]
    assert sorted(order) == list(range(len(ds))) and order != sorted(order)
    pipe = dt.Pipeline(ds, **common)
    it = iter(pipe)
    for _ in range(3):
        next(it)
    state = pipe.state_dict()
    it.close()
    resumed = dt.Pipeline(ds, **common)
    resumed.load_state_dict(state)
    for (a, b), (c, d) in zip(resumed, batches[3:], strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)


def _fails(client, source, out, match: str, **options) -> None:
    with pytest.raises(dt.SourceError, match=match):
        dt.prepare(source, out, client=client, progress=False, **options)
    assert not out.exists()


def test_bad_inputs_are_refused_by_name(client, corpus, tokenizer_json, tmp_path):
    root, _ = corpus
    out = tmp_path / "out.zarr"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    _fails(client, tmp_path / "empty", out, "is empty: its 1 file")
    _fails(client, root, out, "no files in .* match --text-glob '\\*.rst'", text_glob="*.rst")
    _fails(client, root / "a.txt", out, "fewer than the 1,025 one sequence needs")
    _fails(client, root, out, "tokenizer file .*nope.json' does not exist",
           tokenizer=str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    _fails(client, root, out, "not a valid tokenizer.json", tokenizer=str(tmp_path / "bad.json"))
    _fails(client, root, out, "has no token '<eot>'", tokenizer=str(tokenizer_json[0]),
           eot_token="<eot>")
    pd.DataFrame({"body": ["a", "b"], "n": [1, 2]}).to_parquet(tmp_path / "t.parquet")
    _fails(client, tmp_path / "t.parquet", out, "has no column 'text'.*columns: \\['body', 'n'\\]",
           text_column="text")
    _fails(client, tmp_path / "t.parquet", out, "column 'n' .* holds int64, not text",
           text_column="n")
    pd.DataFrame({"body": ["", None]}).to_parquet(tmp_path / "blank.parquet")
    _fails(client, tmp_path / "blank.parquet", out, "cell\\(s\\) of column 'body' are all empty",
           text_column="body")
    _fails(client, tmp_path / "t.parquet", out, "is a table: name its column", seq_len=8)
    _fails(client, root, out, "normalize standardises float features", normalize=True)
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "l.txt").write_bytes("café\n".encode("latin-1"))
    _fails(client, tmp_path / "latin1", out, "l.txt .* is not UTF-8 text",
           tokenizer=str(tokenizer_json[0]))
    with pytest.raises(ValueError, match="seq_len must be a positive integer, got 0"):
        dt.prepare(root, out, client=client, seq_len=0)


def test_a_file_changed_after_listing_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("one line\n")
    files, _ = list_files(tmp_path, None)
    (tmp_path / "a.txt").write_text("another, longer line\n")
    with pytest.raises(dt.SourceError, match="changed while the corpus was being prepared"):
        read_part(file_pieces(files)[0][0])


def test_without_the_tokenizers_package_the_error_says_what_to_install(monkeypatch, tmp_path):
    (tmp_path / "t.json").write_text(f'{{"version": "1.0", "unique": "{tmp_path}"}}')
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    from dasktrain.datasets.tokenizers import get_tokenizer

    with pytest.raises(dt.SourceError, match=r"pip install 'dasktrain\[text\]'"):
        get_tokenizer(str(tmp_path / "t.json"))


def test_cli_errors_are_one_line_with_exit_status_2(corpus, tmp_path):
    root, _ = corpus
    out = str(tmp_path / "out.zarr")
    pd.DataFrame({"body": ["a"]}).to_csv(tmp_path / "t.csv", index=False)
    cases = [
        (["--seq-len", "0"], root, "seq_len must be a positive integer, got 0"),
        (["--tokenizer", str(tmp_path / "missing.json")], root, "does not exist"),
        (["--text-column", "text"], tmp_path / "t.csv", "has no column 'text'"),
    ]
    results = run_cli_batch([["prepare", str(source), out, "--no-progress", *args]
                             for args, source, _ in cases])
    for result, (_, _, fragment) in zip(results, cases, strict=True):
        assert_user_error(result, fragment)
