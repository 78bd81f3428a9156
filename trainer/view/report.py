"""A run's report: PNG figures and one self-contained HTML page, written into a directory.

The page embeds every figure as a base64 data URI (it works alone: mailed, attached, opened
offline) and names the PNG file of each in its caption. Every file is written atomically,
the figures before the page, so the page found in the directory is always a complete one
whose figures exist.
"""

from __future__ import annotations

import base64
import datetime
import html
import os
from pathlib import Path
from typing import Any

from dasktrain.trainer.driver.files import write_atomically
from dasktrain.trainer.view import numbers
from dasktrain.trainer.view.numbers import Shown
from dasktrain.trainer.view.plots import FIGURES, event_versions, metric_names, png_bytes
from dasktrain.trainer.view.run_record import RunRecord

__all__ = ["PAGE", "summary_rows", "write_report"]

PAGE = "index.html"


def summary_rows(history: RunRecord) -> list[tuple[str, str]]:
    """The summary table's rows, (label, the value as shown), in page order."""
    summary = history.summary()
    last = history.epochs[-1] if history.epochs else {}
    rows: list[tuple[str, Any, Shown]] = [
        ("mode", summary["mode"] or "\N{EN DASH}", str),
        ("workers", summary["workers"], numbers.count),
        ("epochs", len(history.epochs), numbers.count),
        ("updates", summary["updates"], numbers.count),
        ("final loss", summary["final_loss"], numbers.metric),
    ]
    rows += [(f"final training {name}", value, numbers.metric)
             for name, value in (last.get("train") or {}).items() if name != "loss"]
    rows += [(f"validation {name}", value, numbers.metric)
             for name, value in (last.get("validation") or {}).items()]
    rows += [
        ("wall time (s)", summary["wall_time_s"], numbers.seconds),
        ("samples/s", summary["samples_per_s"], numbers.rate),
        ("mean staleness", summary["mean_staleness"], numbers.shown(".2f")),
        ("max staleness", summary["max_staleness"], numbers.count),
        ("data stall, last epoch", summary["data_stall"], numbers.share),
        ("dropped gradients", summary["dropped_gradients"], numbers.count),
        ("refused gradients", summary["refused_gradients"], numbers.count),
        ("events", summary["events"], numbers.count),
    ]
    return [(label, show(value)) for label, value, show in rows]


def write_report(history: RunRecord, path: str | os.PathLike) -> Path:
    """Write ``history``'s figures (``loss.png``, ``metrics.png``, ...) and ``index.html``
    into the directory ``path`` (created if missing); returns the page's path."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"cannot write a report into {directory}: it is a file "
                                 "(give a directory)")
    directory.mkdir(parents=True, exist_ok=True)
    figures = []
    for name, (build, caption) in FIGURES.items():
        if name == "events" and not event_versions(history):
            continue  # the event list below says there were none
        fig = build(history)
        data = png_bytes(fig)
        write_atomically(directory / f"{name}.png", data)
        figures.append((name, caption, data))
    page = _page(history, figures)
    return write_atomically(directory / PAGE, page)


def _page(history: RunRecord, figures: list[tuple[str, str, bytes]]) -> str:
    title = f"dasktrain run: {history.mode or 'run'}, {history.workers} worker(s)"
    made = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    parts = [_HEAD.replace("{title}", html.escape(title)),
             f"<h1>{html.escape(title)}</h1>",
             f'<p class="made">Report written {html.escape(made)}.</p>',
             '<h2>Summary</h2><table class="summary" id="summary">']
    for label, text in summary_rows(history):
        parts.append(f"<tr><th>{html.escape(label)}</th><td>{html.escape(text)}</td></tr>")
    parts.append("</table>")
    parts.append(_epochs_table(history))
    parts.append("<h2>Figures</h2>")
    for name, caption, data in figures:
        encoded = base64.b64encode(data).decode("ascii")
        file = f"{name}.png"
        parts.append(
            f'<figure id="{name}"><img src="data:image/png;base64,{encoded}" '
            f'alt="{html.escape(caption)}">'
            f'<figcaption>{html.escape(caption)} <a href="{file}">{file}</a></figcaption>'
            "</figure>")
    parts.append(_events_list(history))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _epochs_table(history: RunRecord) -> str:
    if not history.epochs:
        return "<h2>Epochs</h2><p>No epoch completed.</p>"
    train = [n for n in metric_names(history)
             if any(n in (r.get("train") or {}) for r in history.epochs)]
    validation = [n for n in metric_names(history)
                  if any(n in (r.get("validation") or {}) for r in history.epochs)]
    head = (["epoch", "wall time (s)", "samples", "samples/s", "data stall"]
            + [f"training {n}" for n in train] + [f"validation {n}" for n in validation])
    shows = ([numbers.count, numbers.seconds, numbers.count, numbers.rate, numbers.share]
             + [numbers.metric] * (len(train) + len(validation)))
    rows = ["<h2>Epochs</h2><table class=\"epochs\" id=\"epochs\"><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for r in history.epochs:
        cells = [r.get("epoch"), r.get("wall_s"), r.get("samples"), r.get("samples_per_s"),
                 r.get("stall")]
        cells += [(r.get("train") or {}).get(n) for n in train]
        cells += [(r.get("validation") or {}).get(n) for n in validation]
        rows.append("<tr>" + "".join(f"<td>{html.escape(show(c))}</td>"
                                     for show, c in zip(shows, cells, strict=True)) + "</tr>")
    rows.append("</table>")
    return "\n".join(rows)


def _events_list(history: RunRecord) -> str:
    out = ['<h2>Events</h2>']
    if history.refused_gradients:
        out.append(f"<p>{history.refused_gradients} gradient(s) refused "
                   "(non-finite loss or gradient).</p>")
    if not history.events:
        out.append("<p>No event: no worker was lost or rejoined, no gradient refused.</p>")
        return "\n".join(out)
    out.append('<ol class="events" id="events">')
    out += [f"<li>{html.escape(event)}</li>" for event in history.events]
    out.append("</ol>")
    return "\n".join(out)


_HEAD = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto;
       max-width: 1040px; padding: 0 16px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
p.made { color: #777; margin-top: 0; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { padding: 3px 12px; border-bottom: 1px solid #eee; text-align: left; }
table.summary th { font-weight: 600; color: #444; }
table.epochs td { text-align: right; }
figure { margin: 1.2em 0; }
figure img { width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.92em; }
ol.events { font-family: ui-monospace, monospace; font-size: 0.9em; }
</style></head><body>"""
