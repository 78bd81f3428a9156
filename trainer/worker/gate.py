"""Forward passes that start while the holder's reply is still arriving.

The direct channel can receive a reply's parameters bucket by bucket on its own thread (see
:mod:`dasktrain.trainer.exchange.arrival`), in the order a forward pass reads them. A
:class:`ForwardGate` puts a pre-hook on every module that owns tensors: the module's
forward waits until the buckets holding its own parameters and buffers have landed, and
the model's forward as a whole waits for every bucket before it returns. The first layers
then compute while the last ones are still on the wire.

This is exact only if nothing reads a tensor before its module's forward began (a parent
module using a child's weight directly, a custom ``step`` reading parameters before the
forward pass). So the gate checks the first computation of a replica, whose parameters are
all in place, under a :class:`~torch.overrides.TorchFunctionMode` that sees every tensor
each torch function is given: a tensor read before its bucket would have been waited for
turns replies streamed off for this replica (they are then received whole, as before).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from dasktrain.trainer.exchange.arrival import Arrival
from dasktrain.trainer.exchange.buckets import bucket_of

__all__ = ["ForwardGate"]

logger = logging.getLogger(__name__)

Order = tuple[tuple[int, int], ...]


class ForwardGate:
    """Hooks on ``model`` that wait, in each module's forward, for what
    ``arrival()`` (the reply still arriving, or None) has not landed yet of that module's
    tensors.

    ``tensors`` are the model's flat tensors (trainable parameters, then float32 buffers)
    in the order of the payload, and ``order`` the reply's slices as they travel.
    """

    def __init__(self, model: torch.nn.Module, tensors: Sequence[torch.Tensor],
                 order: Order, arrival: Callable[[], Arrival | None]) -> None:
        self._arrival = arrival
        self._bucket_of: dict[int, int] = {}  # id of a tensor -> its bucket in ``order``
        offset = 0
        for tensor in tensors:
            stop = offset + tensor.numel()
            self._bucket_of[id(tensor)] = bucket_of(order, offset, stop)
            offset = stop
        self._last = len(order) - 1
        self._released = self._last  # while checking: the last bucket waited for
        self._checking: _Reads | None = None
        self.verified: bool | None = None
        """None until :meth:`check` saw a first computation; then whether forward passes
        may start before a reply has landed."""
        self._handles = []
        try:
            for module in model.modules():
                own = [t for t in (*module._parameters.values(), *module._buffers.values())
                       if t is not None and id(t) in self._bucket_of]
                if own:
                    need = max(self._bucket_of[id(t)] for t in own)
                    self._handles.append(
                        module.register_forward_pre_hook(self._waiter(need)))
            self._handles.append(model.register_forward_hook(self._after_forward))
        except RuntimeError:  # modules that take no hooks (TorchScript): none at all
            self.remove()
            raise

    def _waiter(self, need: int) -> Callable[..., None]:
        def before_forward(module: torch.nn.Module, args: Any) -> None:
            del module, args
            if self._checking is not None:
                self._released = max(self._released, need)
                return
            arrival = self._arrival()
            if arrival is not None:
                arrival.wait(need)

        return before_forward

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        del module, args, output
        if self._checking is not None:
            self._released = self._last
            return
        self.settle()

    def settle(self) -> None:
        """Wait for the whole reply (what reads the model outside a forward pass)."""
        arrival = self._arrival()
        if arrival is not None:
            arrival.wait()

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        """Around a replica's first computation (forward and loss, its parameters in place):
        afterwards :attr:`verified` says whether every tensor was read only once its bucket
        would have been waited for."""
        reads = _Reads(self._bucket_of, lambda: self._released)
        self._checking, self._released = reads, -1
        try:
            with reads:
                yield
        finally:
            self._checking, self._released = None, self._last
        self.verified = reads.early is None
        if reads.early is not None:
            logger.info("replies are received whole: %s reads a model tensor before its "
                        "module's forward pass", reads.early)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _Reads(TorchFunctionMode):
    """Notes the first torch function given a tensor of the model whose bucket is later
    than ``released()``."""

    def __init__(self, bucket_of: dict[int, int], released: Callable[[], int]) -> None:
        super().__init__()
        self._bucket_of = bucket_of
        self._released = released
        self.early: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.early is None:
            released = self._released()
            for value in _leaves((args, kwargs)):
                bucket = self._bucket_of.get(id(value))
                if bucket is not None and bucket > released:
                    self.early = getattr(func, "__name__", repr(func))
                    break
        return func(*args, **kwargs)


def _leaves(value: Any) -> Iterator[Any]:
    """The tensors in nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
