"""An optimizer's state over one flat parameter, as one flat float32 array and back.

Parameter averaging (``average`` mode) can average the workers' optimizer states with their
parameters. Which state an optimizer keeps (momentum; Adam's moments and step) is found
once by taking one step on a two-value stand-in: tensors of two values are per-element
state (``num_params`` values each), tensors of one value are scalars.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dasktrain.trainer.optim import OptimizerConfig

__all__ = ["StateLayout"]


@dataclasses.dataclass(frozen=True, slots=True)
class StateLayout:
    """Keys of an optimizer's per-parameter state: ``(name, per_element, dtype)``."""

    keys: tuple[tuple[str, bool, torch.dtype], ...]

    @classmethod
    def of(cls, config: OptimizerConfig) -> StateLayout:
        stand_in = torch.nn.Parameter(torch.ones(1, 2))
        optimizer = config.build([stand_in], segments=[("stand_in", 0, 2, (1, 2))])
        stand_in.grad = torch.full((1, 2), 0.5)
        optimizer.step()
        keys = []
        for name, value in sorted(optimizer.state[stand_in].items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                keys.append((name, value.numel() == 2, value.dtype))
        return cls(tuple(keys))

    def size(self, num_params: int) -> int:
        """Values in the flat form."""
        return sum(num_params if per_element else 1 for _, per_element, _ in self.keys)

    def flatten(self, optimizer: torch.optim.Optimizer, param: torch.Tensor,
                out: np.ndarray) -> None:
        """Write ``param``'s state into ``out`` (zeros for state not made yet)."""
        state = optimizer.state.get(param, {})
        at = 0
        for name, per_element, _ in self.keys:
            size = param.numel() if per_element else 1
            value = state.get(name)
            target = torch.from_numpy(out[at:at + size])
            if isinstance(value, torch.Tensor):
                target.copy_(value.detach().reshape(-1).float())
            else:
                target.zero_()
            at += size

    def load(self, optimizer: torch.optim.Optimizer, param: torch.Tensor,
             values: np.ndarray) -> None:
        """Make ``values`` (from :meth:`flatten`, or an average of such) ``param``'s state."""
        state = {}
        at = 0
        for name, per_element, dtype in self.keys:
            size = param.numel() if per_element else 1
            chunk = torch.from_numpy(np.array(values[at:at + size], dtype=np.float32))
            state[name] = (chunk.reshape(param.shape) if per_element
                           else chunk.reshape(())).to(dtype)
            at += size
        optimizer.state[param] = state
