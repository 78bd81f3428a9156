"""Dict batches of datasets of several named arrays: tensors keyed by array name that also
know each array's role, so that a trainer's default step can call a model of several
inputs (``model(**batch.inputs)``) and compare its output with ``batch.target``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dasktrain.datasets import Dataset

__all__ = ["NamedBatch", "check_pair_batches"]


class NamedBatch(dict[str, torch.Tensor]):
    """A batch as a dict of tensors keyed by array name (``as_dict=True``), with roles.

    Everything a dict does, it does (a custom ``step(model, batch)`` reads
    ``batch["image"]``); :attr:`inputs` and :attr:`target` sort the arrays by the roles
    the dataset records. An array a transform adds has no role: only a custom step sees it.
    """

    __slots__ = ("roles",)

    def __init__(self, tensors: Mapping[str, torch.Tensor], roles: Mapping[str, str]) -> None:
        super().__init__(tensors)
        self.roles: dict[str, str] = dict(roles)  # of the dataset the batch comes from

    def __reduce__(self) -> tuple:
        # A dict subclass pickles its items but not its slots by default.
        return (NamedBatch, (dict(self), self.roles))

    def _of_role(self, role: str) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self.items() if self.roles.get(n) == role}

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """The ``features`` arrays, the model's keyword arguments: ``model(**inputs)``."""
        return self._of_role("features")

    @property
    def targets(self) -> dict[str, torch.Tensor]:
        """The ``targets`` arrays, by name."""
        return self._of_role("targets")

    @property
    def target(self) -> torch.Tensor | None:
        """The one ``targets`` array, or None where there is none.

        Raises
        ------
        ValueError
            With several targets arrays: which one a loss compares with is for a custom
            ``step(model, batch)`` to say.
        """
        targets = self.targets
        if len(targets) > 1:
            raise ValueError(f"the batch has {len(targets)} targets arrays "
                             f"({', '.join(map(repr, targets))}): give the trainer a "
                             "step=fn(model, batch) that says how the loss uses them")
        return next(iter(targets.values()), None)


def check_pair_batches(dataset: Dataset) -> None:
    """Refuse ``(x, y)`` batches of a dataset they cannot hold whole: several features
    (or targets) arrays would leave all but the first out, silently.

    Raises
    ------
    ValueError
        Naming the arrays and the fix, ``as_dict=True``.
    """
    for role in ("features", "targets"):
        names = dataset.names_with_role(role)
        if len(names) > 1:
            raise ValueError(
                f"{dataset.url} has {len(names)} {role} arrays ({', '.join(map(repr, names))}): "
                "(x, y) batches would leave all but the first out; use as_dict=True for "
                "batches keyed by array name")
