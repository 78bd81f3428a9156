"""Any element-wise ``torch.optim`` optimizer on the holder, by class: RMSprop, Adagrad,
Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop, or one of your own.

The holder optimises one flat buffer (its runs, with parameter groups), so the optimizer
must give on the buffer what it gives on the model's own tensors: the update of an element
may depend only on that element's gradient and state, and on scalars such as the step count.
That is checked once per class and settings, by stepping the optimizer on a matrix and a
vector and on their flat concatenation; an optimizer that differs (Adafactor's factored
moments, Muon's orthogonalised matrices) or cannot step on gradients alone (LBFGS re-evaluates
the loss through a closure) is refused with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dasktrain.trainer.optim.config import OptimizerConfig
    from dasktrain.trainer.optim.large_batch import Segments

__all__ = ["build", "check", "class_path", "load_class"]

# Fields of OptimizerConfig that belong to the built-in optimizers; a torch class takes
# its own settings through ``options`` instead.
_BUILT_IN_FIELDS = ("momentum", "nesterov", "betas", "eps", "trust_coefficient")

_WHY_NOT = {
    "torch.optim.LBFGS": "it re-evaluates the loss through a closure at every step, "
                          "which a holder that receives only gradients cannot give",
    "torch.optim.SparseAdam": "it needs sparse gradients; the holder's are dense",
}


def class_path(cls: type) -> str:
    """The import path of ``cls`` stored in a config: ``torch.optim.Name`` for torch's own
    optimizers (so one class has one path), else ``module.QualName``."""
    import torch

    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def load_class(path: str) -> type:
    """The optimizer class at import path ``path``."""
    import torch

    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except ImportError as exc:
        raise ValueError(f"torch_class {path!r}: cannot import {module!r} ({exc})") from None
    except AttributeError:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"torch_class {path!r} is not a torch.optim.Optimizer class")
    return cls


def _takes(cls: type, name: str) -> bool:
    parameters = inspect.signature(cls.__init__).parameters
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _constructor_options(config: OptimizerConfig, cls: type) -> dict[str, Any]:
    options = {"lr": config.lr, **config.options}
    if _takes(cls, "weight_decay"):
        options["weight_decay"] = config.weight_decay
    return options


def check(config: OptimizerConfig) -> None:
    """Refuse a ``"torch"`` config whose class is missing, not element-wise, or given
    settings it does not take."""
    from dasktrain.trainer.optim.config import OptimizerConfig

    if not isinstance(config.torch_class, str) or not config.torch_class:
        raise ValueError("optimizer 'torch' needs torch_class, the optimizer's import path "
                         "(use dt.optim.torch_optimizer(torch.optim.RMSprop, lr=...))")
    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}
    given = [f for f in _BUILT_IN_FIELDS if getattr(config, f) != defaults[f]]
    if given:
        raise ValueError(f"{config.torch_class}: pass {given} as the class's own keyword "
                         f"arguments (options), not as fields of the config")
    cls = load_class(config.torch_class)
    object.__setattr__(config, "torch_class", class_path(cls))  # one path per class
    if config.weight_decay and not _takes(cls, "weight_decay"):
        raise ValueError(f"{config.torch_class} takes no weight_decay")
    reason = _not_element_wise(config.torch_class, config.lr,
                               tuple(sorted(config.options.items(), key=lambda kv: kv[0])),
                               config.weight_decay)
    if reason:
        raise ValueError(f"{config.torch_class} cannot run on the holder: {reason}")


@functools.lru_cache(maxsize=64)
def _not_element_wise(path: str, lr: float, options: tuple[tuple[str, Any], ...],
                      weight_decay: float) -> str | None:
    """Why the optimizer at ``path`` with these settings cannot optimise a flat buffer
    (None: it can)."""
    import torch

    if path in _WHY_NOT:
        return _WHY_NOT[path]
    cls = load_class(path)
    kwargs = {"lr": lr, **dict(options)}
    if _takes(cls, "weight_decay"):
        kwargs["weight_decay"] = weight_decay
    generator = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (4,)]
    start = [torch.randn(s, generator=generator) for s in shapes]
    steps = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(3)]
    tensors = [torch.nn.Parameter(v.clone()) for v in start]
    flat = torch.nn.Parameter(torch.cat([v.reshape(-1) for v in start]))
    try:
        per_tensor, on_flat = cls(tensors, **kwargs), cls([flat], **kwargs)
        for grads in steps:
            for p, g in zip(tensors, grads, strict=True):
                p.grad = g.clone()
            flat.grad = torch.cat([g.reshape(-1) for g in grads])
            per_tensor.step()
            on_flat.step()
    except Exception as exc:  # whatever the class raises: it cannot step on gradients alone
        return (f"it cannot take a step on a flat buffer from its gradient alone "
                f"({type(exc).__name__}: {exc})")
    joined = torch.cat([p.detach().reshape(-1) for p in tensors])
    if not torch.allclose(joined, flat.detach(), rtol=1e-5, atol=1e-7):
        return ("it is not element-wise (its update of a tensor depends on the tensor's "
                "shape or on other elements, e.g. factored moments or matrix norms), and "
                "the holder optimises one flat buffer")
    return None


def build(config: OptimizerConfig, params: list[Any],
          segments: Segments | None) -> torch.optim.Optimizer:
    cls = load_class(config.torch_class)
    return cls(params, **_constructor_options(config, cls))
