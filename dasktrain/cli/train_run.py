"""One training run from a config file into a run directory: what ``dasktrain train`` does."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dasktrain._cluster import cluster_client
from dasktrain.cli.run_dir import RunDirectory
from dasktrain.trainer.view.callbacks import Callback
from dasktrain.trainer.view.loggers import JsonLinesLogger
from dasktrain.trainer.view.numbers import metric

if TYPE_CHECKING:
    from dasktrain.cli.train_config import TrainConfig
    from dasktrain.trainer.driver.trainer import Trainer
    from dasktrain.trainer.view.history import History

__all__ = ["RunResult", "after_stop", "run_training"]


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    """Where a run's files are, and its History."""

    directory: RunDirectory
    history: History
    report: Path
    """The run report's page (``History.report``)."""
    saved_history: Path
    """The History's file (``History.save``)."""

    def summary(self) -> str:
        """Where everything is, and how the run ended."""
        d = self.directory
        rows = [("run directory", d.path), ("config", d.config), ("model", d.model),
                ("checkpoint", d.checkpoint), ("metrics", d.metrics),
                ("history", self.saved_history), ("report", self.report)]
        lines = [f"{name:<14}{path}" for name, path in rows if path is not None]
        last = self.history.epochs[-1] if self.history.epochs else {}
        if last:
            ended = [f"epoch {last['epoch'] + 1}",
                     *_format_metrics("", last.get("train")),
                     *_format_metrics("val_", last.get("validation")),
                     f"{self.history.wall_time:.1f} s in all"]
            lines.append(f"{'last epoch':<14}{'  '.join(ended)}")
        lines.append(f"load the model with dt.Trainer.load({str(d.model)!r}, model=factory)")
        return "\n".join(lines)


class _Begin(Callback):
    """Writes the resolved config (and trims the metrics of a resumed run) once the fit
    has started, that is after a resume was accepted: a refused resume leaves the run
    directory as it was."""

    steers = False  # it only looks at the epoch's end

    def __init__(self, directory: RunDirectory, config: str,
                 resumed: dict[str, Any] | None) -> None:
        self.directory, self.config, self.resumed = directory, config, resumed

    def on_fit_start(self, trainer: Trainer) -> None:
        self.directory.begin(self.config, self.resumed)


def _format_metrics(prefix: str, values: dict[str, Any] | None) -> list[str]:
    return [f"{prefix}{k} {metric(v)}" for k, v in (values or {}).items()
            if isinstance(v, (int, float))]


class _EpochLines(Callback):
    """One line per epoch on stdout, for runs without a progress bar (logs, CI)."""

    steers = False  # it only looks at the epoch's end

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        parts = [f"epoch {record['epoch'] + 1}/{self.epochs}",
                 *_format_metrics("", record.get("train")),
                 *_format_metrics("val_", record.get("validation")),
                 f"{record['wall_s']:.1f} s"]
        print("  ".join(parts), flush=True)


def _metrics_callback(path: Path) -> Callback:
    """The callback writing ``metrics.jsonl``."""
    return JsonLinesLogger(path)


def _save_history(history: History, directory: RunDirectory) -> tuple[Path, Path]:
    """The History's file and its run report (``index.html``)."""
    history.save(directory.history)
    return directory.history, Path(history.report(directory.report))


def after_stop(run_dir: str | os.PathLike, error: BaseException | None = None) -> str:
    """What is left of a run that stopped (interrupted, or ``error``), and what to do."""
    from dasktrain.trainer.errors import TrainingDiverged

    directory = RunDirectory(Path(run_dir))
    if not directory.has_checkpoint():
        return f"no checkpoint was written in {directory.path}"
    if isinstance(error, TrainingDiverged):  # resuming as it is would diverge again
        return f"the last checkpoint before it is in {directory.checkpoint}"
    return f"the last checkpoint is in {directory.checkpoint}: continue with --resume"


def run_training(config: TrainConfig, run_dir: str | os.PathLike | None = None, *,
                 scheduler: str | None = None, resume: bool = False,
                 progress: bool = True) -> RunResult:
    """Train as ``config`` says, writing the run directory.

    Parameters
    ----------
    config
        From :func:`~dasktrain.cli.train_config.load_train_config`.
    run_dir
        Where the run's files go; default ``config.run_dir`` (``[run] dir``).
    scheduler
        Address of a Dask scheduler to run on; default: a LocalCluster started and closed
        here.
    resume
        Continue the run in ``run_dir`` from its checkpoint (more epochs are allowed; the
        Trainer refuses settings that would change the run, naming them).
    progress
        Show a progress bar; without one, a line per epoch is printed.

    Raises
    ------
    ValueError
        The run directory does not fit (a run is there without ``resume``, or no
        checkpoint with it), or the Trainer refuses to resume with these settings.
    """
    directory = RunDirectory(Path(run_dir) if run_dir is not None else config.run_dir)
    resumed = directory.start(resume)
    resolved = dict(config.resolved)
    resolved["run"] = {**resolved["run"], "dir": str(directory.path.resolve())}
    text = dataclasses.replace(config, resolved=resolved).to_toml()
    callbacks: list[Callback] = [_Begin(directory, text, resumed),
                                 _metrics_callback(directory.metrics)]
    if not progress:
        callbacks.append(_EpochLines(config.epochs))
    trainer = config.trainer
    with cluster_client(scheduler=scheduler) as client:
        history = trainer.fit(config.train, epochs=config.epochs,
                              validation=config.validation, client=client,
                              checkpoint=directory.checkpoint,
                              resume=directory.checkpoint if resume else None,
                              callbacks=callbacks)
    trainer.save(directory.model)
    saved, report = _save_history(history, directory)
    return RunResult(directory=directory, history=history, report=report,
                     saved_history=saved)
