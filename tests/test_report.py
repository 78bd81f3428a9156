"""Seeing a run: History figures, the HTML report, save/load and comparing runs, from real
fits on the session cluster."""

from __future__ import annotations

import base64
import functools
import html.parser
import json
import math
import re

import numpy as np
import pytest
from matplotlib.figure import Figure

import dasktrain as dt
from dasktrain.trainer.view.plots import KINDS, event_versions
from tests.common.training import mlp, mse, nan_on


def mae(output, target):
    return (output - target.reshape(output.shape)).abs().mean()


class HalveLearningRate(dt.Callback):
    """Leaves an event stamped with the holder's version after every epoch."""

    def on_epoch_end(self, trainer, record):
        trainer.set_lr_factor(0.5)


@pytest.fixture(scope="module")
def regression(client, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "reg.zarr"
    return dt.prepare("regression", out, client=client, samples=800, width=4, chunk_rows=100,
                      seed=3, split="train=0.75,val=0.25", progress=False)


@pytest.fixture(scope="module")
def sync_history(client, regression):
    train = regression.split("train")
    special = float(train.y[:1].compute().ravel()[0])  # one batch per epoch has a NaN loss
    trainer = dt.Trainer(mlp, functools.partial(nan_on, special=special),
                         dt.optim.sgd(0.05, momentum=0.9), "sync", workers=2, batch_size=16,
                         metrics={"mae": mae}, on_nonfinite="skip", progress=False)
    return trainer.fit(train, epochs=2, validation=regression.split("val"), client=client,
                       callbacks=[HalveLearningRate()])


@pytest.fixture(scope="module")
def async_history(client, regression):
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.02), "async", workers=2, batch_size=16,
                         progress=False)
    return trainer.fit(regression.split("train"), epochs=2, validation=regression.split("val"),
                       client=client)


def test_epoch_records_say_what_each_worker_did(sync_history):
    for record in sync_history.epochs:
        workers = record["per_worker"]
        assert [w["worker"] for w in workers] == [0, 1]
        # The holder applied every batch the workers computed but the one skipped (one a
        # epoch has a NaN loss): the epoch's samples are those it applied.
        assert sum(w["samples"] for w in workers) == record["samples"] + 16
        for w in workers:
            assert 0.0 <= w["stall"] <= 1.0
            assert w["samples_per_s"] > 0


class _Page(html.parser.HTMLParser):
    """The summary table, image sources, links and event items of a report page."""

    def __init__(self) -> None:
        super().__init__()
        self.summary: dict[str, str] = {}
        self.epochs: list[list[str]] = []  # the epochs table's rows, its head first
        self.images: list[str] = []
        self.links: list[str] = []
        self.events: list[str] = []
        self._table = self._cell = None
        self._row: list[str] = []
        self._in_events = False
        self._text = ""

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = attrs.get("id")
        elif tag in ("th", "td"):
            self._cell, self._text = tag, ""
        elif tag == "tr":
            self._row = []
        elif tag == "img":
            self.images.append(attrs["src"])
        elif tag in ("a", "link", "script") and (attrs.get("href") or attrs.get("src")):
            self.links.append(attrs.get("href") or attrs.get("src"))
        elif tag == "ol" and attrs.get("id") == "events":
            self._in_events = True
        elif tag == "li":
            self._text = ""

    def handle_endtag(self, tag):
        if tag in ("th", "td"):
            self._row.append(self._text.strip())
            self._cell = None
        elif tag == "tr" and self._table == "summary":
            self.summary[self._row[0]] = self._row[1]
        elif tag == "tr" and self._table == "epochs":
            self.epochs.append(self._row)
        elif tag == "table":
            self._table = None
        elif tag == "li" and self._in_events:
            self.events.append(self._text.strip())
        elif tag == "ol":
            self._in_events = False

    def handle_data(self, data):
        self._text += data


def test_report_writes_pngs_and_one_self_contained_page(sync_history, tmp_path):
    history = sync_history
    page_path = history.report(tmp_path / "report")
    assert page_path == tmp_path / "report" / "index.html"
    text = page_path.read_text()
    page = _Page()
    page.feed(text)

    pngs = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert pngs == sorted(f"{name}.png" for name in
                          ("loss", "metrics", "staleness", "contributors", "workers",
                           "events"))
    assert not [p for p in (tmp_path / "report").iterdir() if p.name.startswith(".")]
    # Each figure is embedded (the page works alone) and its file named beside it.
    assert sorted(page.links) == pngs
    embedded = [base64.b64decode(src.split(",", 1)[1]) for src in page.images]
    assert all(src.startswith("data:image/png;base64,") for src in page.images)
    assert sorted(embedded) == sorted((tmp_path / "report" / p).read_bytes() for p in pngs)
    assert all(data.startswith(b"\x89PNG\r\n\x1a\n") for data in embedded)
    assert "http://" not in text and "https://" not in text

    # Numbers as the command shows them: metrics to 4 significant digits, counts and rates
    # whole with thousands separated, seconds to two decimals, the stall in per cent.
    shown = page.summary
    assert shown["mode"] == "sync" and shown["workers"] == "2" and shown["epochs"] == "2"
    assert shown["updates"] == f"{history.updates:,}"
    assert shown["final loss"] == f"{history.loss[-1]:.4g}"
    validation = history.epochs[-1]["validation"]
    assert shown["validation loss"] == f"{validation['loss']:.4g}"
    assert shown["validation mae"] == f"{validation['mae']:.4g}"
    assert shown["final training mae"] == f"{history.epochs[-1]['train']['mae']:.4g}"
    assert shown["wall time (s)"] == f"{history.wall_time:,.2f}"
    assert shown["samples/s"] == f"{history.samples_per_second:,.0f}"
    assert shown["data stall, last epoch"] == f"{history.epochs[-1]['stall']:.1%}"
    assert shown["mean staleness"] == "0.00" and shown["max staleness"] == "0"
    assert shown["refused gradients"] == str(history.refused_gradients) == "2"
    head, *rows = page.epochs
    assert head[:5] == ["epoch", "wall time (s)", "samples", "samples/s", "data stall"]
    for row, record in zip(rows, history.epochs, strict=True):
        assert row[:5] == [str(record["epoch"]), f"{record['wall_s']:,.2f}",
                           f"{record['samples']:,}", f"{record['samples_per_s']:,.0f}",
                           f"{record['stall']:.1%}"]
        assert row[head.index("validation mae")] == f"{record['validation']['mae']:.4g}"
    # No raw float anywhere: at most 4 significant digits after a decimal point.
    cells = [*shown.values(), *(c for r in rows for c in r)]
    assert not [c for c in cells if re.search(r"\.0*[1-9]\d{4,}", c)], cells
    assert shown["events"] == str(len(history.events))
    assert page.events == history.events
    assert any("learning rate factor set to 0.5" in e for e in page.events)
    assert any("refused" in e for e in page.events)


def test_a_report_goes_into_a_run_directory_beside_what_is_there(sync_history, tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"kept")
    sync_history.report(tmp_path)
    sync_history.report(tmp_path)  # rewritten in place
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"kept"
    assert (tmp_path / "index.html").exists()
    with pytest.raises(NotADirectoryError, match="is a file"):
        sync_history.report(tmp_path / "checkpoint.pt")


def test_an_empty_history_still_reports(tmp_path):
    history = dt.History(mode="async", workers=3)
    text = history.report(tmp_path).read_text()
    assert "No epoch completed" in text and "No event" in text
    for kind in KINDS:
        assert isinstance(history.plot(kind), Figure)


def test_plot_draws_the_history(sync_history):
    history = sync_history
    for kind in KINDS:
        fig = history.plot(kind)
        assert isinstance(fig, Figure) and fig.axes
    by_update, by_time = history.plot("loss").axes
    (raw,) = [line for line in by_update.lines if line.get_gid() == "loss"]
    np.testing.assert_allclose(raw.get_xdata(), history.version)
    np.testing.assert_allclose(raw.get_ydata(), history.loss)
    (raw,) = [line for line in by_time.lines if line.get_gid() == "loss"]
    x, y = np.asarray(raw.get_xdata()), np.asarray(raw.get_ydata())
    breaks = np.isnan(x)  # pauses between epochs break the line
    np.testing.assert_allclose(x[~breaks], np.asarray(history.time) - history.time[0])
    np.testing.assert_allclose(y[~breaks], history.loss)
    assert np.isnan(y[breaks]).all()
    # The holder's events (here: learning-rate changes, refused gradients) are marked.
    marked = [line.get_xdata()[0] for line in by_update.lines if line.get_gid() == "event"]
    assert marked == [v for v, _ in event_versions(history)] and marked
    titles = [ax.get_title() for ax in history.plot("metrics").axes if ax.get_visible()]
    assert titles == ["loss per epoch", "mae per epoch"]
    with pytest.raises(ValueError, match="unknown plot 'los'"):
        history.plot("los")


def test_save_and_load_give_the_same_history(sync_history, async_history, tmp_path):
    path = async_history.save(tmp_path / "history.json")
    assert path == tmp_path / "history.json"
    assert [p.name for p in tmp_path.iterdir()] == ["history.json"]  # no temporary left
    loaded = dt.History.load(path)
    assert loaded == async_history
    assert loaded.summary() == async_history.summary()
    # The run with a refused NaN batch: left out of its epoch's loss, counted instead.
    loaded = dt.History.load(sync_history.save(tmp_path / "sync.json"))
    assert loaded.loss == sync_history.loss and loaded.events == sync_history.events
    assert loaded.epochs[0]["skipped_steps"] == 1
    # Non-finite numbers survive too.
    odd = dt.History(loss=[float("nan")], epochs=[{"train": {"loss": float("inf")}}])
    loaded = dt.History.load(odd.save(tmp_path / "odd.json"))
    assert math.isnan(loaded.loss[0]) and math.isinf(loaded.epochs[0]["train"]["loss"])

    (tmp_path / "other.json").write_text(json.dumps({"loss": [1.0]}))
    with pytest.raises(ValueError, match=r"other\.json is not a saved History"):
        dt.History.load(tmp_path / "other.json")
    (tmp_path / "broken.json").write_text('{"format": ')
    with pytest.raises(ValueError, match=r"broken\.json is not a saved History"):
        dt.History.load(tmp_path / "broken.json")


def _labels(ax):
    return [line.get_label() for line in ax.lines if not line.get_label().startswith("_")]


def test_compare_draws_every_run_on_the_same_axes(sync_history, async_history, tmp_path):
    fig = dt.compare({"sync": sync_history, "async": async_history},
                     path=tmp_path / "compare.png")
    assert (tmp_path / "compare.png").read_bytes().startswith(b"\x89PNG")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["training loss by update", "training loss by wall time",
                      "loss per epoch (validation; dashed: training)", "throughput per epoch"]
    for ax in fig.axes:
        assert _labels(ax) == ["sync", "async"], ax.get_title()
    by_update = fig.axes[0]
    assert len(by_update.lines[1].get_xdata()) == async_history.updates
    per_epoch = fig.axes[2]
    np.testing.assert_allclose(per_epoch.lines[0].get_ydata(),
                               [r["validation"]["loss"] for r in sync_history.epochs])

    # A list is labelled by mode; a repeated mode is numbered.
    fig = dt.compare([sync_history, async_history, sync_history])
    assert _labels(fig.axes[0]) == ["sync", "async", "sync (2)"]
    with pytest.raises(TypeError, match="'b' is a dict, not a History"):
        dt.compare({"a": sync_history, "b": {}})
    with pytest.raises(ValueError, match="at least one"):
        dt.compare([])
