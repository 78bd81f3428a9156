"""The run directory of ``dasktrain train``: what one training run leaves behind.

::

    runs/digits/
      config.toml        the resolved config: every setting, defaults filled in
      metrics.jsonl      one JSON line per update ("kind": "update") and per epoch ("epoch")
      checkpoint/        the resumable state (checkpoint.pt, checkpoint-updates.jsonl)
      model.pt           the final model: dt.Trainer.load(path, model=factory)
      history.json       the History (History.save)
      report/            the run report (History.report: index.html and figures)

Every file is written atomically (a temporary sibling renamed into place) except
``metrics.jsonl``, which grows a line at a time; a resume first cuts it back to what the
checkpoint it resumes from had seen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dasktrain.trainer.driver.checkpoint import checkpoint_file, load_checkpoint
from dasktrain.trainer.driver.files import write_atomically

if TYPE_CHECKING:
    pass

__all__ = ["RunDirectory"]


@dataclasses.dataclass(frozen=True, slots=True)
class RunDirectory:
    """The files of one run under ``path``."""

    path: Path

    @property
    def config(self) -> Path:
        return self.path / "config.toml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint"

    @property
    def model(self) -> Path:
        return self.path / "model.pt"

    @property
    def history(self) -> Path:
        return self.path / "history.json"

    @property
    def report(self) -> Path:
        return self.path / "report"

    def has_checkpoint(self) -> bool:
        return checkpoint_file(self.checkpoint).is_file()

    def start(self, resume: bool) -> dict[str, Any] | None:
        """Make the directory ready for a fresh run, or for a resume (returning the
        checkpoint's state); refuse what would lose a run or someone's files.

        Raises
        ------
        ValueError
            Without ``resume``: the directory holds a run (a checkpoint), or files that are
            not a run's. With ``resume``: it holds no readable checkpoint.
        """
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"run directory {self.path} is not a directory")
        if resume:
            if not self.has_checkpoint():
                raise ValueError(f"{self.path} holds no checkpoint to resume from (start "
                                 "the run without --resume)")
            return load_checkpoint(self.checkpoint)
        if self.has_checkpoint():
            what = "a finished run" if self.model.is_file() else "a run"
            raise ValueError(f"{self.path} already holds {what}; continue it with --resume, "
                             "or choose another directory with --run-dir")
        if self.path.is_dir() and any(self.path.iterdir()) and not self.config.is_file():
            raise ValueError(f"{self.path} is not empty and not a dasktrain run directory; "
                             "choose another with --run-dir")
        # A run that stopped before its first checkpoint left nothing to resume: restart.
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics.unlink(missing_ok=True)
        return None

    def begin(self, config: str, resumed: dict[str, Any] | None) -> None:
        """Once the fit has started (a resume was accepted): write the resolved config,
        and cut ``metrics.jsonl`` back to what the checkpoint ``resumed`` from had seen."""
        if resumed is not None:
            self._trim_metrics(int(resumed["holder"]["version"]),
                               int(resumed["complete_epochs"]))
        self.write_config(config)

    def _trim_metrics(self, version: int, complete_epochs: int) -> None:
        """Keep the lines of what the checkpoint holds: the resumed fit redoes the rest."""
        if not self.metrics.is_file():
            return
        kept = []
        for line in self.metrics.read_text(encoding="utf-8").splitlines(keepends=True):
            with contextlib.suppress(ValueError):
                if not line.endswith("\n"):
                    break  # cut short by a crash
                row = json.loads(line)
                if row.get("kind") == "update" and row.get("version", 0) > version:
                    continue
                if row.get("kind") == "epoch" and row.get("epoch", 0) >= complete_epochs:
                    continue
                kept.append(line)
        write_atomically(self.metrics, "".join(kept))

    def write_config(self, text: str) -> None:
        """The resolved config, atomically."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomically(self.config, text)
