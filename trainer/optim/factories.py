"""The front doors of ``dt.optim``: one function per built-in optimizer, any element-wise
``torch.optim`` class (:func:`torch_optimizer`), and :func:`get_optimizer` by name."""

from __future__ import annotations

from typing import Any

from dasktrain.trainer.optim.config import OptimizerConfig
from dasktrain.trainer.optim.torch_class import class_path

__all__ = ["adam", "adamw", "get_optimizer", "lamb", "lars", "sgd", "torch_optimizer"]

# OptimizerConfig fields that every optimizer takes (the rest are the built-ins' own).
_COMMON_FIELDS = ("exclude_bias_and_norm", "groups", "warmup_steps", "schedule",
                  "total_steps", "step_size", "gamma")
# Built-ins whose settings are fields of the config, each with its own function here.
_OWN_FACTORIES = ("sgd", "adam", "adamw", "lars", "lamb")


def get_optimizer(name: str, **options: Any) -> OptimizerConfig:
    """An optimizer config by name: ``get_optimizer("sgd", lr=0.1, momentum=0.9)``.

    ``options`` are fields of :class:`OptimizerConfig`; for an optimizer added with
    :func:`~dasktrain.trainer.optim.register_optimizer`, keyword arguments that are not
    fields go to its ``options``.
    """
    import dataclasses

    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    own = {k: v for k, v in options.items() if k not in fields}
    if own:
        if name in _OWN_FACTORIES:
            raise TypeError(f"optimizer {name!r} has no setting {sorted(own)} (its torch "
                            f"keyword arguments go in options={{...}})")
        options = {k: v for k, v in options.items() if k in fields}
        options["options"] = {**options.get("options", {}), **own}
    return OptimizerConfig(name=name, **options)


def torch_optimizer(cls: type | str, lr: float, *, weight_decay: float = 0.0,
                    **options: Any) -> OptimizerConfig:
    """Any element-wise ``torch.optim`` optimizer class on the holder.

    ``dt.optim.torch_optimizer(torch.optim.RMSprop, lr=0.01, alpha=0.9)``. The class must
    update each element from its own gradient and state (checked here, once per class and
    settings: LBFGS, SparseAdam, Adafactor and Muon are refused with the reason).

    Parameters
    ----------
    cls
        The optimizer class, or its import path (``"torch.optim.RMSprop"``).
    lr
        Base learning rate (times warm-up and schedule).
    weight_decay
        Passed to the class (refused if it takes none); per-group decays and
        ``exclude_bias_and_norm`` apply as for the built-ins.
    **options
        The class's own keyword arguments (``alpha``, ``momentum``, ``centered``...), and
        the common settings ``groups``, ``exclude_bias_and_norm``, ``warmup_steps``,
        ``schedule``, ``total_steps``, ``step_size``, ``gamma``.
    """
    path = cls if isinstance(cls, str) else class_path(cls)
    common = {k: options.pop(k) for k in _COMMON_FIELDS if k in options}
    return OptimizerConfig(name="torch", torch_class=path, lr=lr, weight_decay=weight_decay,
                           options=options, **common)


def sgd(lr: float, *, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, **options: Any) -> OptimizerConfig:
    """SGD with optional momentum, Nesterov and weight decay.

    ``options`` takes ``exclude_bias_and_norm`` and ``groups`` (parameter groups, see
    :func:`group`) and the schedule: ``warmup_steps``, ``schedule``, ``total_steps``,
    ``step_size`` and ``gamma`` (see :class:`OptimizerConfig`); so do :func:`adam` and
    :func:`adamw`.
    """
    return OptimizerConfig(name="sgd", lr=lr, momentum=momentum, nesterov=nesterov,
                           weight_decay=weight_decay, **options)


def adam(lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, **options: Any) -> OptimizerConfig:
    """Adam (L2 weight decay added to the gradient, as ``torch.optim.Adam``)."""
    return OptimizerConfig(name="adam", lr=lr, betas=betas, eps=eps,
                           weight_decay=weight_decay, **options)


def adamw(lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01, **options: Any) -> OptimizerConfig:
    """AdamW (decoupled weight decay)."""
    return OptimizerConfig(name="adamw", lr=lr, betas=betas, eps=eps,
                           weight_decay=weight_decay, **options)


def lars(lr: float, *, momentum: float = 0.9, weight_decay: float = 0.0,
         trust_coefficient: float = 0.001, eps: float = 1e-8,
         exclude_bias_and_norm: bool = True, **schedule: Any) -> OptimizerConfig:
    """LARS: momentum SGD with a per-tensor learning rate
    ``trust_coefficient * |w| / (|g| + weight_decay * |w|)``.

    For large global batches (You et al. 2017, "Large Batch Training of Convolutional
    Networks"); the update is written out in :class:`LARS`. Learning rates are typically
    far larger than plain SGD's, since ``trust_coefficient`` scales them down.

    Parameters
    ----------
    lr
        Base learning rate (times warm-up and schedule).
    momentum
        Momentum of the (learning-rate-scaled) update.
    weight_decay
        L2 penalty: added to the gradient, and ``weight_decay * |w|`` to the trust
        ratio's denominator (the paper's and apex LARC's ratio).
    trust_coefficient
        How far one update may move a tensor, relative to its norm.
    eps
        Added to the gradient norm in the trust ratio.
    exclude_bias_and_norm
        Tensors of at most one dimension (biases, norm layers) get no weight decay and a
        trust ratio of 1: plain momentum SGD at ``lr``.
    **schedule
        ``groups`` (:func:`group`), and ``warmup_steps``, ``schedule``, ``total_steps``,
        ``step_size``, ``gamma`` (see :class:`OptimizerConfig`).
    """
    return OptimizerConfig(name="lars", lr=lr, momentum=momentum, weight_decay=weight_decay,
                           trust_coefficient=trust_coefficient, eps=eps,
                           exclude_bias_and_norm=exclude_bias_and_norm, **schedule)


def lamb(lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
         weight_decay: float = 0.01, exclude_bias_and_norm: bool = True, **schedule: Any
         ) -> OptimizerConfig:
    """LAMB: an AdamW step rescaled per tensor to ``lr * |w|`` (trust ratio ``|w| / |u|``).

    For large global batches (You et al. 2019, "Large Batch Optimization for Deep
    Learning: Training BERT in 76 minutes"); the update is written out in :class:`LAMB`.

    Parameters
    ----------
    lr
        Base learning rate (times warm-up and schedule): roughly the fraction of its norm
        one update moves a tensor.
    betas
        Decay rates of the first and second moments.
    eps
        Added to the square root of the second moment.
    weight_decay
        Decoupled decay, added to the Adam direction before the trust ratio.
    exclude_bias_and_norm
        Tensors of at most one dimension (biases, norm layers) get no weight decay and a
        trust ratio of 1: a plain Adam step at ``lr``.
    **schedule
        ``groups`` (:func:`group`), and ``warmup_steps``, ``schedule``, ``total_steps``,
        ``step_size``, ``gamma`` (see :class:`OptimizerConfig`).
    """
    return OptimizerConfig(name="lamb", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                           exclude_bias_and_norm=exclude_bias_and_norm, **schedule)
