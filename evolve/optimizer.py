"""The ES update's optimizers in numpy: SGD (momentum, Nesterov), Adam and AdamW on one flat
float32 vector, with ``torch.optim``'s arithmetic.

Every worker process and the driver apply the same update to their own copy of the
parameters, so the result must be bit-identical everywhere. These optimizers are
element-wise float32 numpy operations in a fixed order, with every scalar coefficient
computed in float64 from the settings and the step number, then rounded once to float32:
no reduction, no thread count and no fused kernel can change a value. (torch's own
optimizers compute the same formulas, agreeing to float32 rounding; their fused CPU kernels
may contract multiply-adds, which is why they are not used here.)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dasktrain.trainer.optim import OptimizerConfig

__all__ = ["OptimizerState", "initial_state", "optimizer_step"]


@dataclasses.dataclass(slots=True)
class OptimizerState:
    """The optimizer's step count and its buffers (float32, the parameters' size)."""

    step: int
    buffers: dict[str, np.ndarray]

    def copy(self) -> OptimizerState:
        return OptimizerState(self.step, {k: v.copy() for k, v in self.buffers.items()})


def initial_state(config: OptimizerConfig, size: int) -> OptimizerState:
    """A fresh state for ``size`` parameters."""
    if config.name == "sgd":
        names = ("momentum",) if config.momentum else ()
    else:
        names = ("exp_avg", "exp_avg_sq")
    return OptimizerState(0, {n: np.zeros(size, dtype=np.float32) for n in names})


def _f32(value: float) -> np.float32:
    return np.float32(value)


def optimizer_step(config: OptimizerConfig, params: np.ndarray, grad: np.ndarray,
                   state: OptimizerState, lr: float) -> None:
    """One step of ``config``'s optimizer on ``params`` (updated in place) along ``grad``
    (a loss gradient: the step goes against it), at learning rate ``lr``. ``grad`` is used
    as scratch space."""
    state.step += 1
    decay = config.weight_decay
    if config.name == "adamw":
        if decay:
            params *= _f32(1.0 - lr * decay)
    elif decay:
        grad += _f32(decay) * params
    if config.name == "sgd":
        _sgd(config, params, grad, state, lr)
    else:
        _adam(config, params, grad, state, lr)


def _sgd(config: OptimizerConfig, params: np.ndarray, grad: np.ndarray,
         state: OptimizerState, lr: float) -> None:
    if config.momentum:
        buf = state.buffers["momentum"]
        if state.step == 1:
            buf[:] = grad
        else:
            buf *= _f32(config.momentum)
            buf += grad
        if config.nesterov:
            grad += _f32(config.momentum) * buf
        else:
            grad = buf
    params -= _f32(lr) * grad


def _adam(config: OptimizerConfig, params: np.ndarray, grad: np.ndarray,
          state: OptimizerState, lr: float) -> None:
    beta1, beta2 = config.betas
    m, v = state.buffers["exp_avg"], state.buffers["exp_avg_sq"]
    # m = beta1 m + (1 - beta1) g ; v = beta2 v + (1 - beta2) g^2
    m *= _f32(beta1)
    m += _f32(1.0 - beta1) * grad
    v *= _f32(beta2)
    grad *= grad
    v += _f32(1.0 - beta2) * grad
    bias1 = 1.0 - beta1 ** state.step
    bias2 = 1.0 - beta2 ** state.step
    # p -= lr / bias1 * m / (sqrt(v) / sqrt(bias2) + eps), as torch.optim.Adam computes it
    denom = np.sqrt(v)
    denom /= _f32(math.sqrt(bias2))
    denom += _f32(config.eps)
    np.divide(m, denom, out=denom)
    denom *= _f32(lr / bias1)
    params -= denom
