"""The live view during a real fit: its JSON holds the updates so far, its page is served
from 127.0.0.1 and needs nothing else, and the server is gone once the fit ends."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections import Counter

import pytest

import dasktrain as dt
from tests.common.training import mlp, mse


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


class Probe(dt.Callback):
    """Reads the live view from the driver while the fit runs, as a browser would."""

    def __init__(self, view: dt.LiveView) -> None:
        self.view = view
        self.seen: list[tuple[list[float], dict]] = []
        self.epochs_seen: list[tuple[int, dict]] = []

    def on_fit_start(self, trainer):
        self.page = _get(self.view.url).decode()

    def on_update(self, trainer, records):
        data = json.loads(_get(self.view.url + "data.json"))
        self.seen.append((list(trainer.history.loss), data))

    def on_epoch_end(self, trainer, record):
        data = json.loads(_get(self.view.url + "data.json?since=5"))
        self.epochs_seen.append((len(trainer.history.loss), data))


@pytest.fixture(scope="module")
def regression(client, tmp_path_factory):
    out = tmp_path_factory.mktemp("live") / "reg.zarr"
    return dt.prepare("regression", out, client=client, samples=400, width=4, chunk_rows=100,
                      seed=7, progress=False)


def test_the_live_view_serves_the_run_while_it_goes(client, regression, capsys):
    view = dt.LiveView()
    probe = Probe(view)
    trainer = dt.Trainer(mlp, mse, dt.optim.sgd(0.05), "async", workers=2, batch_size=16,
                         progress=False)
    history = trainer.fit(regression, epochs=2, client=client, callbacks=[view, probe])

    url = capsys.readouterr().err.split("dasktrain live view: ")[1].split()[0]
    assert url.startswith("http://127.0.0.1:")
    assert "<canvas" in probe.page and "data.json" in probe.page
    assert "src=\"http" not in probe.page and "://" not in probe.page.split("<script>")[1]

    assert probe.seen
    for loss_so_far, data in probe.seen:
        assert data["state"] == "running" and data["mode"] == "async"
        assert data["total_updates"] == len(loss_so_far)
        assert data["updates"]["loss"] == loss_so_far
    # The staleness histogram counts the gradients of the updates so far.
    loss_so_far, data = probe.seen[-1]
    gradients = sum(history.gradients[:len(loss_so_far)])
    expected = Counter(s for s, d in zip(history.staleness[:gradients],
                                         history.dropped[:gradients], strict=True) if not d)
    assert {int(k): v for k, v in data["staleness"]["applied"].items()} == expected

    # At each epoch end: the updates from the 5th on, and that epoch's per-worker stall.
    for epoch, (count, data) in enumerate(probe.epochs_seen):
        assert data["total_updates"] == count
        assert data["updates"]["version"] == history.version[5:count]
        assert len(data["epochs"]) == epoch + 1
        assert [w["worker"] for w in data["epochs"][-1]["per_worker"]] == [0, 1]

    assert view.url is None
    with pytest.raises(urllib.error.URLError):
        _get(url + "data.json")


def test_the_live_view_can_be_closed_without_a_fit_and_names_a_taken_port():
    view = dt.LiveView(show_url=False)
    view.close()  # nothing started: nothing to do
    assert view.url is None
    with pytest.raises(ValueError, match="port must be"):
        dt.LiveView(port=70000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        view = dt.LiveView(port=port, show_url=False)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            view.on_fit_start(dt.Trainer(mlp, mse, dt.optim.sgd(0.1), progress=False))
        assert view.url is None
