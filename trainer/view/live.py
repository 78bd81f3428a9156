"""A live view of a fit in the browser: a small page on 127.0.0.1 that polls the run's
figures (loss, throughput, staleness, per-worker data stall) as they arrive.

The server is the standard library's, on a daemon thread of the driver; the page draws on
canvases with inline JavaScript, so it needs nothing from the internet.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

from dasktrain.trainer.driver.update_log import rows_of
from dasktrain.trainer.view.callbacks import Callback
from dasktrain.trainer.view.live_page import PAGE
from dasktrain.trainer.view.loggers import strict_json

if TYPE_CHECKING:
    from dasktrain.trainer.driver.trainer import Trainer
    from dasktrain.trainer.view.history import History

__all__ = ["LiveView"]

logger = logging.getLogger(__name__)

_UPDATE_FIELDS = ("version", "time", "loss", "samples", "contributors")


class _State:
    """What the page shows, fed by the fit's callbacks and read by the server's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mode, self.workers, self.state = "", 0, "starting"
        self.updates: dict[str, list] = {name: [] for name in _UPDATE_FIELDS}
        self.staleness: dict[int, int] = {}
        self.dropped = 0
        self.epochs: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.refused = 0

    def add_updates(self, records: dict[str, list]) -> None:
        with self.lock:
            for row in rows_of(records):
                for name in _UPDATE_FIELDS:
                    self.updates[name].append(row[name])
                for value, dropped in zip(row.get("staleness", ()),
                                          row.get("dropped", ()), strict=False):
                    if dropped:
                        self.dropped += 1
                    else:
                        self.staleness[int(value)] = self.staleness.get(int(value), 0) + 1

    def snapshot(self, since: int) -> dict[str, Any]:
        with self.lock:
            return {
                "mode": self.mode, "workers": self.workers, "state": self.state,
                "total_updates": len(self.updates["loss"]), "since": since,
                "updates": {name: values[since:] for name, values in self.updates.items()},
                "staleness": {"applied": {str(k): v for k, v in sorted(self.staleness.items())},
                              "dropped": self.dropped},
                "epochs": [{k: r.get(k) for k in ("epoch", "wall_s", "samples_per_s", "stall",
                                                  "per_worker", "train", "validation")}
                           for r in self.epochs],
                "events": list(self.events), "refused_gradients": self.refused,
            }


class LiveView(Callback):
    """Serve a live page of the fit at :attr:`url` while it runs.

    ``trainer.fit(..., callbacks=[dt.LiveView()])`` prints the address once when the fit
    starts; the page shows the loss per update, samples/s, the staleness histogram and each
    worker's data stall per epoch, refreshed every second from ``/data.json``
    (``?since=N`` gives the updates from the N-th on). The server stops when the fit ends;
    if the fit fails it stays up, showing where the run stopped, until :meth:`close` (or
    use ``with dt.LiveView() as view: ...``).

    Parameters
    ----------
    port
        Port to listen on; 0 picks a free one.
    host
        Address to bind; the loopback by default (reach a remote driver with an SSH tunnel).
    show_url
        Print the address on stderr when the server starts.
    """

    steers = False  # it only looks at the epoch's end

    def __init__(self, port: int = 0, host: str = "127.0.0.1", show_url: bool = True) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an integer from 0 to 65535, got {port!r}")
        self.port, self.host, self.show_url = port, host, show_url
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._state = _State()

    @property
    def url(self) -> str | None:
        """The page's address while the server runs, else None."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/"

    def on_fit_start(self, trainer: Trainer) -> None:
        self.close()
        state = self._state = _State()
        history = trainer.history
        state.mode, state.workers = trainer.mode, trainer.workers
        if history is not None and history.loss:  # a resumed fit shows its past too
            state.add_updates(history.records())
            state.epochs = list(history.epochs)
            state.events = list(history.events)
        state.state = "running"
        self._server = _serve(self.host, self.port, state)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.2},
                                        name="dasktrain-live-view", daemon=True)
        self._thread.start()
        logger.info("live view at %s", self.url)
        if self.show_url:
            print(f"dasktrain live view: {self.url}", file=sys.stderr, flush=True)

    def on_update(self, trainer: Trainer, records: dict[str, list]) -> None:
        self._state.add_updates(records)
        self._sync_events(trainer.history)

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        with self._state.lock:
            self._state.epochs.append(record)
        self._sync_events(trainer.history)

    def on_fit_end(self, trainer: Trainer, history: History) -> None:
        self._sync_events(history)
        with self._state.lock:
            self._state.state = "finished"
        self.close()

    def _sync_events(self, history: History | None) -> None:
        if history is None:
            return
        with self._state.lock:
            self._state.events = list(history.events)
            self._state.refused = history.refused_gradients

    def close(self) -> None:
        """Stop the server (done when the fit ends)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> LiveView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(host: str, port: int, state: _State) -> ThreadingHTTPServer:
    page = PAGE.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path in ("/", "/index.html"):
                self._send(page, "text/html; charset=utf-8")
            elif url.path == "/data.json":
                try:
                    since = max(0, int(parse_qs(url.query).get("since", ["0"])[0]))
                except ValueError:
                    self.send_error(400, "since must be an integer")
                    return
                body = json.dumps(strict_json(state.snapshot(since)), allow_nan=False)
                self._send(body.encode(), "application/json")
            else:
                self.send_error(404)

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("live view: " + format, *args)

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        raise OSError(f"the live view cannot listen on {host}:{port}: {exc.strerror or exc} "
                      "(port=0 picks a free port)") from exc
    server.daemon_threads = True
    return server
