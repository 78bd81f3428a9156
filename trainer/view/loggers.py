"""Metric loggers: callbacks that send a fit's updates and epochs to a JSON-lines file,
TensorBoard or MLflow as the run goes."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dasktrain.trainer.driver.update_log import rows_of
from dasktrain.trainer.view.callbacks import Callback

if TYPE_CHECKING:
    from dasktrain.trainer.driver.trainer import Trainer
    from dasktrain.trainer.view.history import History

__all__ = ["JsonLinesLogger", "MLflowLogger", "TensorBoardLogger", "epoch_scalars",
           "strict_json"]


def epoch_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of an epoch record, flat: ``samples_per_s``, ``stall``, ``train_<m>``,
    ``val_<m>``, ``worker<i>_stall``, ``worker<i>_samples_per_s``, ``worker<i>_batch_rows``
    (its share of a ``sync`` step, see the Trainer's ``balance``)."""
    out: dict[str, float] = {}
    for name in ("wall_s", "samples", "samples_per_s", "stall", "exchange_s"):
        if record.get(name) is not None:
            out[name] = float(record[name])
    for prefix, where in (("train_", "train"), ("val_", "validation")):
        for name, value in (record.get(where) or {}).items():
            out[prefix + name] = float(value)
    for entry in record.get("per_worker") or ():
        for name in ("stall", "samples_per_s", "batch_rows"):
            if entry.get(name) is not None:
                out[f"worker{entry['worker']}_{name}"] = float(entry[name])
    return out


def _check_every(every: int) -> int:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every must be a positive integer (log every n-th update), got "
                         f"{every!r}")
    return every


def strict_json(value: Any) -> Any:
    """``value`` with non-finite floats as None and numpy scalars as Python numbers:
    JSON that every reader takes (``NaN`` is not JSON, a browser refuses it)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars
        return strict_json(value.item())
    return value


class JsonLinesLogger(Callback):
    """Append one JSON line per logged update and per epoch to ``path``, flushed as the
    run goes (so ``tail -f`` and other processes see it live).

    Update lines: ``{"kind": "update", "version", "time", "loss", "samples",
    "contributors", "gradients", "staleness": [...], ...}`` for every ``every``-th update
    (by holder version), with that update's gradients' entries as lists. Epoch lines:
    ``{"kind": "epoch", ...}`` with the epoch record of :attr:`History.epochs`. Strict
    JSON: a non-finite number is written as ``null``. A resumed fit appends to the same
    file.
    """

    steers = False  # it only looks at the epoch's end

    def __init__(self, path: str | os.PathLike, every: int = 1) -> None:
        self.path = Path(path)
        self.every = _check_every(every)
        if self.path.is_dir():
            raise IsADirectoryError(f"JsonLinesLogger needs a file path, {self.path} is a "
                                    "directory (e.g. give run/metrics.jsonl)")

    def _write(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        text = "".join(json.dumps(strict_json(row), allow_nan=False) + "\n" for row in rows)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Opened per call: nothing stays open if the fit fails, and each call adds whole
        # lines in one write.
        with self.path.open("a", encoding="utf-8") as f:
            f.write(text)
            f.flush()

    def on_update(self, trainer: Trainer, records: dict[str, list]) -> None:
        self._write([{"kind": "update", **row} for row in rows_of(records)
                     if int(row["version"]) % self.every == 0])

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self._write([{"kind": "epoch", **record}])


def _missing(package: str, extra: str, exc: ImportError) -> ImportError:
    return ImportError(f"{package} is not installed: pip install \"dasktrain[{extra}]\" "
                       f"(or pip install {package}) ({exc})")


class TensorBoardLogger(Callback):
    """Write scalars for TensorBoard (``tensorboard --logdir LOG_DIR``).

    Per update (step = holder version): ``train/loss``, ``train/contributors``,
    ``train/staleness`` (mean of the update's gradients). Per epoch (step = epoch):
    ``epoch/samples_per_s``, ``epoch/stall``, ``epoch/train_<metric>``,
    ``epoch/val_<metric>``, ``workers/stall/<i>``, ``workers/samples_per_s/<i>``,
    ``workers/batch_rows/<i>``, and a
    histogram of the epoch's staleness. ``every``: log every n-th update only. Needs the
    ``tensorboard`` package (``pip install "dasktrain[tensorboard]"``).
    """

    steers = False  # it only looks at the epoch's end

    def __init__(self, log_dir: str | os.PathLike, every: int = 1) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise _missing("tensorboard", "tensorboard", exc) from exc
        self._writer_class = SummaryWriter
        self.log_dir = Path(log_dir)
        self.every = _check_every(every)
        self.writer: Any = None
        self._staleness: list[int] = []

    def on_fit_start(self, trainer: Trainer) -> None:
        self.close()
        self.writer = self._writer_class(log_dir=str(self.log_dir), flush_secs=10)
        self._staleness = []

    def on_update(self, trainer: Trainer, records: dict[str, list]) -> None:
        if self.writer is None:
            return
        for row in rows_of(records):
            self._staleness.extend(row.get("staleness", ()))
            step = int(row["version"])
            if step % self.every:
                continue
            self.writer.add_scalar("train/loss", row["loss"], step)
            self.writer.add_scalar("train/contributors", row["contributors"], step)
            if row.get("staleness"):
                staleness = row["staleness"]
                self.writer.add_scalar("train/staleness", sum(staleness) / len(staleness),
                                       step)

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        epoch = int(record["epoch"])
        for name, value in epoch_scalars(record).items():
            if name.startswith("worker"):
                worker, field = name[len("worker"):].split("_", 1)
                self.writer.add_scalar(f"workers/{field}/{worker}", value, epoch)
            else:
                self.writer.add_scalar(f"epoch/{name}", value, epoch)
        if self._staleness:
            import numpy as np

            self.writer.add_histogram("epoch/staleness", np.asarray(self._staleness), epoch)
            self._staleness = []
        self.writer.flush()  # an epoch is visible at once, and kept if the fit fails

    def on_fit_end(self, trainer: Trainer, history: History) -> None:
        self.close()

    def close(self) -> None:
        """Flush and close the event file (done when the fit ends)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class MLflowLogger(Callback):
    """Log a fit to MLflow: the trainer's settings as parameters, the loss per update
    (step = holder version) and the epoch figures (step = epoch) as metrics.

    Parameters
    ----------
    experiment
        Experiment name (created if missing); default: ``MLFLOW_EXPERIMENT_NAME`` or
        MLflow's default experiment.
    run_name
        Name of the MLflow run made for the fit.
    tracking_uri
        Where to log (``http://host:5000``, ``sqlite:///mlflow.db``); default: MLflow's own
        (``MLFLOW_TRACKING_URI``).
    every
        Log the loss of every n-th update only (epoch metrics are always logged).

    Notes
    -----
    Inside ``with mlflow.start_run():`` (and no argument given) the fit logs to that run
    and leaves it open. Needs ``mlflow`` (``pip install "dasktrain[mlflow]"``).
    """

    steers = False  # it only looks at the epoch's end

    def __init__(self, experiment: str | None = None, run_name: str | None = None,
                 tracking_uri: str | None = None, every: int = 1) -> None:
        try:
            import mlflow
        except ImportError as exc:
            raise _missing("mlflow", "mlflow", exc) from exc
        self._mlflow = mlflow
        self.experiment, self.run_name, self.tracking_uri = experiment, run_name, tracking_uri
        self.every = _check_every(every)
        self.run_id: str | None = None
        self._client: Any = None
        self._own_run = False

    def on_fit_start(self, trainer: Trainer) -> None:
        from mlflow.tracking import MlflowClient

        mlflow = self._mlflow
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        active = mlflow.active_run()
        if active is not None and self.experiment is None and self.run_name is None \
                and self.tracking_uri is None:
            self.run_id, self._own_run = active.info.run_id, False
        else:
            run = self._client.create_run(self._experiment_id(), run_name=self.run_name,
                                          tags={"dasktrain.mode": trainer.mode})
            self.run_id, self._own_run = run.info.run_id, True
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in _flat_params(trainer._config()).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 per batch
            self._client.log_batch(self.run_id, params=params[i:i + 100])

    def _experiment_id(self) -> str:
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return "0"  # MLflow's default experiment
        found = self._client.get_experiment_by_name(name)
        return found.experiment_id if found else self._client.create_experiment(name)

    def _log(self, values: list[tuple[str, float, int, float]]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(name, float(value), int(stamp * 1000), step)
                   for name, value, step, stamp in values]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1,000 per batch
            self._client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def on_update(self, trainer: Trainer, records: dict[str, list]) -> None:
        if self.run_id is None:
            return
        self._log([("loss", row["loss"], int(row["version"]), row["time"])
                   for row in rows_of(records) if int(row["version"]) % self.every == 0])

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.run_id is None:
            return
        now = time.time()
        self._log([(f"epoch_{name}", value, int(record["epoch"]), now)
                   for name, value in epoch_scalars(record).items()])

    def on_fit_end(self, trainer: Trainer, history: History) -> None:
        if self.run_id is not None and self._own_run:
            self._client.set_terminated(self.run_id, "FINISHED")


def _flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"optimizer.lr": "0.05", ...}`` from nested settings (None left out)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat_params(value, f"{name}."))
        elif value is not None:
            out[name] = str(value)[:500]  # MLflow's limit on a parameter's value
    return out
