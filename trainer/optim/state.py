"""An optimizer's state over a flat parameter buffer, as one flat float32 array and back.

Parameter averaging (``average`` mode) can average the workers' optimizer states with their
parameters. Which state an optimizer keeps (momentum; Adam's moments and step) is found
once by taking one step on a two-value stand-in: tensors of two values are per-element
state, tensors of one value are scalars.

The buffer may be optimised as several pieces (parameter groups cut it into runs): the flat
form holds, key by key, the per-element state of every piece in order (``num_params``
values, aligned with the buffer) or one scalar per piece.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from dasktrain.trainer.optim.config import OptimizerConfig

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

    def size(self, num_params: int, pieces: int = 1) -> int:
        """Values in the flat form of a buffer of ``num_params`` in ``pieces``."""
        return sum(num_params if per_element else pieces for _, per_element, _ in self.keys)

    def flatten(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                out: np.ndarray) -> None:
        """Write the state of ``params`` (the buffer's pieces, in order) into ``out``
        (zeros for state not made yet)."""
        at = 0
        for name, per_element, _ in self.keys:
            for param in params:
                size = param.numel() if per_element else 1
                value = optimizer.state.get(param, {}).get(name)
                target = torch.from_numpy(out[at:at + size])
                if isinstance(value, torch.Tensor):
                    target.copy_(value.detach().reshape(-1).float())
                else:
                    target.zero_()
                at += size

    def load(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
             values: np.ndarray) -> None:
        """Make ``values`` (from :meth:`flatten`, or an average of such) the state of
        ``params``, each tensor where torch's own ``load_state_dict`` puts it: per-element
        state on its parameter's device (a replica's GPU), scalars (Adam's step) on the
        processor unless the optimizer is fused or capturable."""
        states: list[dict[str, torch.Tensor]] = [{} for _ in params]
        on_device = [_scalars_on_device(optimizer, param) for param in params]
        at = 0
        for name, per_element, dtype in self.keys:
            for param, state, scalar_there in zip(params, states, on_device, strict=True):
                size = param.numel() if per_element else 1
                chunk = torch.from_numpy(np.array(values[at:at + size], dtype=np.float32))
                device = param.device if per_element or scalar_there else "cpu"
                state[name] = (chunk.reshape(param.shape) if per_element
                               else chunk.reshape(())).to(device=device, dtype=dtype)
                at += size
        for param, state in zip(params, states, strict=True):
            optimizer.state[param] = state


def _scalars_on_device(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    """Whether ``optimizer`` keeps ``param``'s scalar state on its device (fused or
    capturable groups), not on the processor."""
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return bool(group.get("fused") or group.get("capturable"))
    return False
