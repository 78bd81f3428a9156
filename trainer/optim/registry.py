"""The optimizers the holder can run, looked up by name. The built-in entries are listed in
the package's ``__init__`` (adding one is a module with its builder and an entry there);
:func:`register_optimizer` adds one at run time.

An entry is an :class:`OptimizerKind`: a builder from an
:class:`~dasktrain.trainer.optim.config.OptimizerConfig` to a ``torch.optim`` optimizer,
whether it computes per-tensor ratios from the buffer's segments (LARS, LAMB), and a check
of the config's settings. The holder optimises one flat buffer, so an optimizer that is not
per-tensor must be element-wise: its update of an element may depend only on that element's
own gradient and state (and on scalars such as the step count).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["FIRST_MOMENT_KEYS", "OPTIMIZERS", "Builder", "OptimizerKind", "add_built_in",
           "optimizer_kind", "register_optimizer"]

# The config is typed Any here: the registry sits below OptimizerConfig, which looks its
# name up in it (importing the config's module here would make the two import each other).
Builder = Callable[[Any, list[Any], Any], "torch.optim.Optimizer"]
"""``build(config, params, segments)``: the torch optimizer over ``params`` (tensors or
``torch.optim``-style group dicts, each with its ``lr`` and ``weight_decay``), from an
:class:`~dasktrain.trainer.optim.config.OptimizerConfig` and the buffer's segments."""


def _no_check(config: Any) -> None:
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class OptimizerKind:
    """One entry of the registry."""

    build: Builder
    """Builds the optimizer (imports torch itself: configs stay cheap to make)."""
    per_tensor: bool = False
    """Computes one ratio per model tensor from the segments (then biases and norm
    weights are excluded by default); otherwise the optimizer must be element-wise."""
    check: Callable[[Any], None] = _no_check
    """Refuses settings this optimizer cannot take, with a ``ValueError`` naming them."""
    first_moment: str | None = None
    """The key of its parameter groups that holds the decay of its running mean of
    gradients: ``"momentum"`` (SGD, LARS) or ``"betas"`` (its first entry: Adam, AdamW,
    LAMB); None when it keeps none. The asynchronous modes lower that coefficient by the
    momentum their staleness adds (see :mod:`dasktrain.trainer.modes.momentum`)."""


FIRST_MOMENT_KEYS = (None, "momentum", "betas")
"""What :attr:`OptimizerKind.first_moment` may name."""

OPTIMIZERS: dict[str, OptimizerKind] = {}
_BUILT_IN: set[str] = set()


def add_built_in(entries: dict[str, OptimizerKind]) -> None:
    """The package's own entries (names that :func:`register_optimizer` cannot replace)."""
    OPTIMIZERS.update(entries)
    _BUILT_IN.update(entries)


def optimizer_kind(name: str) -> OptimizerKind:
    """The entry of optimizer ``name``; a clear error for unknown names."""
    try:
        return OPTIMIZERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)} "
                         f"(dt.optim.register_optimizer adds one)") from None


def register_optimizer(name: str, build: Builder, *, per_tensor: bool = False,
                       check: Callable[[Any], None] | None = None,
                       first_moment: str | None = None) -> None:
    """Add optimizer ``name`` to the registry, for ``dt.optim.get_optimizer(name, ...)``.

    Parameters
    ----------
    name
        The new name (built-in names cannot be replaced).
    build
        ``build(config, params, segments)`` returns the ``torch.optim.Optimizer``; it reads
        ``config.lr`` and the other fields it uses, and ``config.options``. It travels with
        the configs that name it, so the holder's worker needs no import of your module.
    per_tensor
        The optimizer computes per-tensor quantities from ``segments`` (see
        :class:`~dasktrain.trainer.optim.large_batch.LARS`); otherwise it must be
        element-wise, as the holder optimises one flat buffer.
    check
        Refuses a config this optimizer cannot run (raise ``ValueError``).
    first_moment
        ``"momentum"`` or ``"betas"``: the parameter-group key of its momentum (a number)
        or of its moment decays (a pair, the first being the gradients' running mean), which
        the asynchronous modes then lower by the momentum staleness adds; None (default):
        left as built.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an optimizer name must be a non-empty string, got {name!r}")
    if name in _BUILT_IN:
        raise ValueError(f"{name!r} is a built-in optimizer; register yours under another "
                         f"name")
    if not callable(build):
        raise TypeError(f"build must be callable, got {build!r}")
    if first_moment not in FIRST_MOMENT_KEYS:
        raise ValueError(f"first_moment must be one of {FIRST_MOMENT_KEYS}, got "
                         f"{first_moment!r}")
    OPTIMIZERS[name] = OptimizerKind(build, per_tensor, check or _no_check, first_moment)


def travelling_kind(name: str) -> OptimizerKind | None:
    """The entry a config of ``name`` carries when pickled: None for built-in names."""
    return None if name in _BUILT_IN else OPTIMIZERS.get(name)


def adopt(name: str, kind: OptimizerKind) -> None:
    """Register ``kind`` under ``name`` where this process does not know it yet."""
    OPTIMIZERS.setdefault(name, kind)
