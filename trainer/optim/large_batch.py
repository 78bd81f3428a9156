"""LARS and LAMB: large-batch optimizers whose update scales each model tensor by a *trust
ratio* of its norms.

The holder optimises one flat buffer; these optimizers take it with its segments
(:meth:`dasktrain.trainer.flat.FlatLayout.param_segments`, one per model tensor) and compute
one ratio per segment, so the flat buffer gets the same updates as the model's own tensors.
Built through :mod:`dasktrain.trainer.optim` (``dt.optim.lars``, ``dt.optim.lamb``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["LAMB", "LARS", "Segment", "Segments"]

Segment = tuple[str, int, int, tuple[int, ...]]
"""One tensor in a flat buffer: ``(name, start, stop, shape)``."""

Segments = Sequence[Segment] | Sequence[Sequence[Segment]]
"""The segments of one flat tensor, or one list of them per optimised tensor."""

# (start, stop, shape) of each tensor inside one optimised tensor, flattened.
_Span = tuple[int, int, tuple[int, ...]]




class _PerTensorOptimizer(torch.optim.Optimizer):
    """Base of the optimizers whose update depends on each model tensor as a whole.

    Every optimised tensor is split into spans ``(start, stop, shape)`` of its flattened
    values: the segments given for a flat buffer, or the whole tensor otherwise. The spans
    are structure, not state: they are not in :meth:`state_dict`, which holds plain
    tensors only (safe for ``torch.load(weights_only=True)``).
    """

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any],
                 segments: Segments | None) -> None:
        super().__init__(params, defaults)
        tensors = [p for group in self.param_groups for p in group["params"]]
        self._spans: dict[torch.Tensor, list[_Span]] = {}
        if segments and not isinstance(segments[0][0], str):
            # One segment list per tensor: several flat pieces (parameter groups).
            if len(segments) != len(tensors):
                raise ValueError(f"{len(segments)} segment lists for {len(tensors)} tensors")
            for tensor, own in zip(tensors, segments, strict=True):
                self._spans[tensor] = _check_segments(own, tensor.numel())
        elif segments is not None:
            if len(tensors) != 1:
                raise ValueError(f"segments describe one flat tensor, but {len(tensors)} "
                                 "tensors were given: pass the flat parameter alone, or "
                                 "no segments")
            self._spans[tensors[0]] = _check_segments(segments, tensors[0].numel())
        elif len(tensors) == 1 and tensors[0].ndim == 1:
            warnings.warn(f"{type(self).__name__} over one 1-D tensor without segments "
                          "takes it as one tensor (a bias, excluded from adaptation by "
                          "default); for a flat buffer of a model's parameters pass "
                          "segments=FlatLayout.param_segments()", stacklevel=3)

    def _spans_of(self, param: torch.Tensor) -> list[_Span]:
        spans = self._spans.get(param)
        return spans if spans is not None else [(0, param.numel(), tuple(param.shape))]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse "
                                       "gradients")
                self._update(group, param, param.view(-1), param.grad.reshape(-1))
        return loss

    def _update(self, group: dict[str, Any], param: torch.Tensor, weights: torch.Tensor,
                grad: torch.Tensor) -> None:
        """One tensor's step: ``weights`` and ``grad`` are its flattened views."""
        raise NotImplementedError


def _check_segments(segments: Sequence[Segment], numel: int) -> list[_Span]:
    spans = []
    position = 0
    for name, start, stop, shape in segments:
        size = math.prod(shape)
        if start != position or stop - start != size:
            raise ValueError(f"segment {name!r} ({start}:{stop}, shape {tuple(shape)}) does "
                             f"not follow the previous one at {position} or does not hold "
                             f"{size} values: segments must tile the flat tensor in order")
        spans.append((int(start), int(stop), tuple(int(d) for d in shape)))
        position = stop
    if position != numel:
        raise ValueError(f"the segments cover {position} values, the flat tensor has "
                         f"{numel}: are they of another model?")
    return spans


def _adapted(shape: tuple[int, ...], group: dict[str, Any]) -> bool:
    """Whether a tensor gets weight decay and a trust ratio (biases and norm-layer
    parameters, at most 1-D, do not when excluded)."""
    return len(shape) > 1 or not group["exclude_bias_and_norm"]


def _trust_ratio(weights: torch.Tensor, update: torch.Tensor, coefficient: float,
                 eps: float, decay: float = 0.0) -> torch.Tensor:
    """``coefficient * |weights| / (|update| + decay * |weights| + eps)``, or 1 where either
    norm is 0 (a zero-initialised tensor must still move; a zero update stays zero). A 0-d
    tensor: no host synchronisation per segment."""
    weight_norm = torch.linalg.vector_norm(weights)
    update_norm = torch.linalg.vector_norm(update)
    return torch.where((weight_norm > 0) & (update_norm > 0),
                       coefficient * weight_norm / (update_norm + decay * weight_norm + eps),
                       1.0)


class LARS(_PerTensorOptimizer):
    """Layer-wise Adaptive Rate Scaling (You et al. 2017), as in NVIDIA apex / torchlars.

    Per tensor ``w`` with gradient ``g`` (tensors of at most one dimension skip the first
    two lines when ``exclude_bias_and_norm``)::

        local_lr = trust_coefficient * |w| / (|g| + weight_decay * |w| + eps)
                                                      if |w| > 0 and |g| > 0, else 1
        v = momentum * v + lr * local_lr * (g + weight_decay * w)   (v starts at 0)
        w = w - v

    The trust ratio is the paper's (Algorithm 1, with ``beta`` the weight decay) and apex
    LARC's: the decay enters the denominator as ``weight_decay * |w|``, not through the norm
    of ``g + weight_decay * w`` (which would let the two partly cancel).

    See :func:`lars` for the parameters; ``segments`` as in :meth:`OptimizerConfig.build`.
    """

    def __init__(self, params: Iterable[Any], lr: float, *, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001,
                 eps: float = 1e-8, exclude_bias_and_norm: bool = True,
                 segments: Segments | None = None) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coefficient": trust_coefficient, "eps": eps,
                    "exclude_bias_and_norm": exclude_bias_and_norm}
        super().__init__(params, defaults, segments)

    def _update(self, group: dict[str, Any], param: torch.Tensor, weights: torch.Tensor,
                grad: torch.Tensor) -> None:
        lr, momentum = group["lr"], group["momentum"]
        # d = local_lr * (g + wd * w), built in one scratch copy of the gradient; the ratio
        # is taken from g before the decay is added.
        update = grad.clone()
        decay = group["weight_decay"]
        for start, stop, shape in self._spans_of(param):
            if _adapted(shape, group):
                w, d = weights[start:stop], update[start:stop]
                ratio = _trust_ratio(w, d, group["trust_coefficient"], group["eps"], decay)
                if decay:
                    d.add_(w, alpha=decay)
                d.mul_(ratio)
        if momentum:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(weights)
            buffer = state["momentum_buffer"]
            buffer.mul_(momentum).add_(update, alpha=lr)
            weights.sub_(buffer)
        else:
            weights.sub_(update, alpha=lr)


class LAMB(_PerTensorOptimizer):
    """Layer-wise Adaptive Moments for Batch training (You et al. 2019).

    At update ``t`` (from 1), per tensor ``w`` with gradient ``g`` (tensors of at most one
    dimension take ``weight_decay = 0`` and ``r = 1`` when ``exclude_bias_and_norm``)::

        m = beta1 * m + (1 - beta1) * g            (m, v start at 0)
        v = beta2 * v + (1 - beta2) * g * g
        u = (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * w
        r = |w| / |u|   if |w| > 0 and |u| > 0, else 1
        w = w - lr * r * u

    No gradient clipping and no bound on ``r`` (the paper's ``phi`` is the identity).
    See :func:`lamb` for the parameters; ``segments`` as in :meth:`OptimizerConfig.build`.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, exclude_bias_and_norm: bool = True,
                 segments: Segments | None = None) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "exclude_bias_and_norm": exclude_bias_and_norm}
        super().__init__(params, defaults, segments)

    def _update(self, group: dict[str, Any], param: torch.Tensor, weights: torch.Tensor,
                grad: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[param]
        if not state:
            # A float32 step, as torch.optim.Adam keeps it: exact up to 2**24.
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(weights)
            state["exp_avg_sq"] = torch.zeros_like(weights)
        state["step"] += 1
        t = int(state["step"].item())
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # The moments element-wise over the whole tensor (flat buffer: all at once).
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = (exp_avg_sq / (1 - beta2**t)).sqrt_().add_(group["eps"])
        update = (exp_avg / (1 - beta1**t)).div_(denominator)
        for start, stop, shape in self._spans_of(param):
            if _adapted(shape, group):
                w, u = weights[start:stop], update[start:stop]
                if group["weight_decay"]:
                    u.add_(w, alpha=group["weight_decay"])
                u.mul_(_trust_ratio(w, u, 1.0, 0.0))
        weights.sub_(update, alpha=group["lr"])
