"""Builders of the built-in optimizers: SGD, Adam and AdamW from ``torch.optim`` (element-wise,
so the buffer's segments change nothing), LARS and LAMB from :mod:`.large_batch` (per-tensor
trust ratios over the segments). Each imports torch on first build: configs are plain data,
cheap to import and send."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dasktrain.trainer.optim.config import OptimizerConfig
    from dasktrain.trainer.optim.large_batch import Segments

__all__ = ["build_adam", "build_adamw", "build_lamb", "build_lars", "build_sgd",
           "no_options"]


def build_sgd(config: OptimizerConfig, params: list[Any],
              segments: Segments | None) -> torch.optim.Optimizer:
    import torch

    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                           nesterov=config.nesterov, weight_decay=config.weight_decay,
                           **config.options)


def _fused_if_possible(kind: Any, params: list[Any], **options: Any) -> torch.optim.Optimizer:
    """``kind(params, fused=True)`` where torch has a fused kernel for these tensors (one
    kernel per step instead of a dozen: it halves the holder's time per update for small
    models), else the default implementation."""
    try:
        return kind(params, fused=True, **options)
    except (RuntimeError, ValueError, TypeError):
        return kind(params, **options)


def build_adam(config: OptimizerConfig, params: list[Any],
               segments: Segments | None) -> torch.optim.Optimizer:
    import torch

    return _fused_if_possible(torch.optim.Adam, params, lr=config.lr, betas=config.betas,
                              eps=config.eps, weight_decay=config.weight_decay,
                              **config.options)


def build_adamw(config: OptimizerConfig, params: list[Any],
                segments: Segments | None) -> torch.optim.Optimizer:
    import torch

    return _fused_if_possible(torch.optim.AdamW, params, lr=config.lr, betas=config.betas,
                              eps=config.eps, weight_decay=config.weight_decay,
                              **config.options)


def build_lars(config: OptimizerConfig, params: list[Any],
               segments: Segments | None) -> torch.optim.Optimizer:
    from dasktrain.trainer.optim.large_batch import LARS

    return LARS(params, config.lr, momentum=config.momentum,
                weight_decay=config.weight_decay, trust_coefficient=config.trust_coefficient,
                eps=config.eps, exclude_bias_and_norm=config.excludes_bias_and_norm,
                segments=segments)


def build_lamb(config: OptimizerConfig, params: list[Any],
               segments: Segments | None) -> torch.optim.Optimizer:
    from dasktrain.trainer.optim.large_batch import LAMB

    return LAMB(params, config.lr, betas=config.betas, eps=config.eps,
                weight_decay=config.weight_decay,
                exclude_bias_and_norm=config.excludes_bias_and_norm, segments=segments)


def no_options(config: OptimizerConfig) -> None:
    """LARS and LAMB take their settings as fields only."""
    if config.options:
        raise ValueError(f"{config.name!r} takes no options; got {sorted(config.options)}")
