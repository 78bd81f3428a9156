"""A model's parameters and gradients as one flat float32 buffer each.

The holder and the workers exchange one contiguous buffer per message (one frame on the
wire, no per-tensor overhead). On a worker the model's parameters and buffers are re-pointed
to views of one flat tensor and the parameters' ``.grad`` to views of another, so
"flattening" costs nothing: backward writes straight into the buffer that is sent, and fresh
parameters are loaded with one copy, or none when received straight into the model.

Gradients are not zeroed before a backward pass: :meth:`FlatModel.zero_grad` sets each
``.grad`` to None, backward then hands each parameter a gradient of its own (the tensor
autograd computed, taken as it is), and a hook run as each parameter's gradient is complete
copies it into the flat buffer and makes ``.grad`` its view again. One copy instead of a
pass that zeroes the buffer and one that adds into it: two fewer passes over the
gradients a step. A parameter backward does not reach gets zeros when the pass is over
(:meth:`FlatModel.gradients_done`).

Layout of a payload: the parameters (in ``named_parameters`` order), then the model's
floating-point buffers (batch-norm running statistics...), each flattened.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["FlatLayout", "FlatModel"]


@dataclasses.dataclass(frozen=True, slots=True)
class FlatLayout:
    """Names and shapes of what a payload carries, in order."""

    params: tuple[tuple[str, tuple[int, ...]], ...]
    buffers: tuple[tuple[str, tuple[int, ...]], ...]
    # Derived once: the holder asks for them on every update.
    _num_params: int = dataclasses.field(init=False, repr=False, compare=False)
    _num_buffers: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_num_params",
                           sum(int(np.prod(s, dtype=np.int64)) for _, s in self.params))
        object.__setattr__(self, "_num_buffers",
                           sum(int(np.prod(s, dtype=np.int64)) for _, s in self.buffers))

    @classmethod
    def of(cls, model: torch.nn.Module) -> FlatLayout:
        params = tuple((n, tuple(p.shape)) for n, p in model.named_parameters()
                       if p.requires_grad)
        buffers = tuple((n, tuple(b.shape)) for n, b in model.named_buffers()
                        if b.is_floating_point())
        if not params:
            raise ValueError("the model has no trainable parameters")
        return cls(params, buffers)

    @property
    def num_params(self) -> int:
        return self._num_params

    @property
    def num_buffers(self) -> int:
        return self._num_buffers

    @property
    def size(self) -> int:
        """Elements in a payload."""
        return self.num_params + self.num_buffers

    def param_segments(self) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """Where each parameter lies in the flat buffer: ``(name, start, stop, shape)``.

        For optimizers that work per tensor (LARS, LAMB: one trust ratio per tensor)
        although the holder keeps one flat buffer; in ``params`` order, so the segments
        tile ``[0, num_params)``.
        """
        segments = []
        start = 0
        for name, shape in self.params:
            stop = start + int(np.prod(shape, dtype=np.int64))
            segments.append((name, start, stop, shape))
            start = stop
        return segments

    @property
    def fingerprint(self) -> str:
        """Short digest of names and shapes: two models agree iff their fingerprints do."""
        text = repr((self.params, self.buffers)).encode()
        return hashlib.sha1(text, usedforsecurity=False).hexdigest()[:12]

    def describe_difference(self, other: FlatLayout) -> str:
        """Where two layouts first differ, for an error message."""
        mine, theirs = dict(self.params + self.buffers), dict(other.params + other.buffers)
        for name in mine.keys() | theirs.keys():
            if mine.get(name) != theirs.get(name):
                return (f"{name}: {mine.get(name, 'missing')} here, "
                        f"{theirs.get(name, 'missing')} there")
        return "same tensors in another order"


class FlatModel:
    """A module whose state (parameters, then buffers) and gradients live in flat buffers.

    Parameters
    ----------
    model
        The module; its parameters and float32 buffers are re-pointed in place.
    device
        Where the model runs. On CUDA the outgoing gradients are staged in pinned host
        memory and copied without blocking.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.model = model.to(self.device)
        self.layout = FlatLayout.of(model)
        params = [p for _, p in model.named_parameters() if p.requires_grad]
        buffers = [b for _, b in model.named_buffers() if b.is_floating_point()]
        n = self.layout.num_params
        pinned = self.device.type == "cuda"
        # The model's state, parameters then buffers, as one tensor: fresh parameters are
        # one copy in (on CPU, received straight into it), the state one copy out.
        self._state = torch.empty(self.layout.size, dtype=torch.float32, device=self.device)
        self.params = self._state[:n]
        # The outgoing payload: gradients then buffers. On CPU the gradients live in it (no
        # copy to send); on CUDA it is pinned host memory the gradients are copied into.
        self._host = torch.zeros(self.layout.size, dtype=torch.float32, pin_memory=pinned)
        self.grads = (self._host[:n] if self.device.type == "cpu" else
                      torch.zeros(n, dtype=torch.float32, device=self.device))
        self._tensors = params + buffers
        offset = 0
        # Buffers of another precision keep their storage and are copied in and out.
        self._copied: list[tuple[int, torch.Tensor]] = []
        for t in self._tensors:
            k = t.numel()
            self._state[offset:offset + k].copy_(t.detach().reshape(-1))
            if t.dtype != torch.float32:
                self._copied.append((offset, t))
            offset += k
        self._grad_params = params
        self._grad_views: list[torch.Tensor] = []
        self._point()
        self._received: np.ndarray | None = None
        # Registered before anything else can be: hooks run in that order, so whoever
        # listens for a finished gradient (the bucket sender) finds it in the flat buffer.
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._into_flat(i))

    def _point(self) -> None:
        """Make the model's parameters and float32 buffers views of the flat state, and
        the parameters' ``.grad`` views of the flat gradients: backward accumulates into
        them in place."""
        offset = 0
        n = self.layout.num_params
        self._grad_views = []
        for i, t in enumerate(self._tensors):
            k = t.numel()
            if i < len(self.layout.params):
                t.data = self.params[offset:offset + k].view_as(t)
                t.grad = self.grads[offset:offset + k].view_as(t)
                self._grad_views.append(t.grad)
            elif t.dtype == torch.float32:
                t.data = self._state[offset:offset + k].view_as(t)
            offset += k
        assert offset == n + self.layout.num_buffers

    def adopt(self, payload: np.ndarray, state: np.ndarray) -> bool:
        """Move the model into ``state`` and its outgoing payload (its gradients) into
        ``payload``, both float32 arrays of a payload's size: memory shared with the holder
        (see :mod:`dasktrain.trainer.exchange.shared`), which then reads the gradients and writes
        fresh parameters where the model has them. Values are kept. False (nothing done)
        where the model does not live on the CPU."""
        size = self.layout.size
        if self.device.type != "cpu" or payload.shape != (size,) or state.shape != (size,):
            return False
        new_state, new_host = torch.from_numpy(state), torch.from_numpy(payload)
        with torch.no_grad():
            new_state.copy_(self._state)
            new_host.copy_(self._host)
        self._state, self._host = new_state, new_host
        self.params = new_state[: self.layout.num_params]
        self.grads = new_host[: self.layout.num_params]
        self._point()
        self._received = state
        return True

    def payload(self) -> np.ndarray:
        """Gradients then buffers, as one contiguous float32 host array (reused: send it
        before the next backward)."""
        n = self.layout.num_params
        self._sync_copied()
        if self.device.type != "cpu":
            self._host[:n].copy_(self.grads, non_blocking=True)
        self._host[n:].copy_(self._state[n:], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return self._host.numpy()

    def state(self) -> np.ndarray:
        """Parameters then buffers, as a new float32 host array."""
        self._sync_copied()
        return self._state.detach().to("cpu", copy=True).numpy()

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The model's trainable parameters then floating-point buffers, in the order of
        a payload."""
        return list(self._tensors)

    def receives_in_place(self) -> bool:
        """Whether a reply received into :meth:`receive_buffer` is the model's state
        itself, with nothing left to copy by :meth:`load`."""
        return self.device.type == "cpu" and not self._copied

    def receive_buffer(self) -> np.ndarray:
        """A host array to receive fresh parameters (then buffers) into; :meth:`load` of it
        costs nothing more on CPU, where it is the model's own state."""
        if self._received is None:
            self._received = (self._state.numpy() if self.device.type == "cpu" else
                              np.empty(self.layout.size, dtype=np.float32))
        return self._received

    def can_view(self) -> bool:
        """Whether :meth:`view` may be used: on CPU, for a model without floating-point
        buffers (its forward pass would write them into memory it does not own)."""
        return self.device.type == "cpu" and self.layout.num_buffers == 0 \
            and not self._copied

    def view(self, values: np.ndarray) -> None:
        """Make ``values``, a writable float32 array of a payload's size, the model's
        state itself: its parameters become views of it, no value is copied. The model only
        reads it; the caller keeps it unchanged while the model computes (a leased reply).
        Only where :meth:`can_view` says so."""
        if values.shape != (self.layout.size,) or values.dtype != np.float32 \
                or not values.flags.writeable or not values.flags.c_contiguous:
            raise ValueError(f"cannot view a {values.dtype} array of shape {values.shape}"
                             f" as {self.layout.size} float32 values")
        if not self.can_view():
            raise RuntimeError("this model cannot view its state (its device, or buffers "
                               "its forward pass writes)")
        if values.ctypes.data == self._state.data_ptr():
            return  # the holder updated it in place: the views see the new values
        self._state = torch.from_numpy(values)
        self.params = self._state[: self.layout.num_params]
        self._point()

    def load(self, values: np.ndarray) -> None:
        """Take parameters then buffers from a payload-shaped array."""
        if values.shape != (self.layout.size,):
            raise ValueError(f"expected {self.layout.size} values, got {values.shape}")
        in_place = self.device.type == "cpu" and values is self._received
        if not in_place:
            with warnings.catch_warnings():
                # Received buffers may be read-only; they are only read here.
                warnings.simplefilter("ignore", UserWarning)
                source = torch.from_numpy(np.ascontiguousarray(values))
        with torch.no_grad():
            if not in_place:
                self._state.copy_(source, non_blocking=True)
            for offset, b in self._copied:
                b.copy_(self._state[offset:offset + b.numel()].view_as(b))

    def _sync_copied(self) -> None:
        """Bring buffers of another precision into the flat state."""
        for offset, b in self._copied:
            self._state[offset:offset + b.numel()].copy_(b.detach().reshape(-1))

    def _into_flat(self, index: int) -> Callable[[torch.Tensor], None]:
        def finished(param: torch.Tensor) -> None:
            view = self._grad_views[index]
            grad = param.grad
            if grad is not None and grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                param.grad = view

        return finished

    def zero_grad(self) -> None:
        """Start the next backward pass from zero gradients (see the module docstring:
        nothing is written now)."""
        for p in self._grad_params:
            p.grad = None

    def gradients_done(self) -> None:
        """After a backward pass: every gradient in the flat buffer, zeros for the
        parameters it did not reach."""
        for p, view in zip(self._grad_params, self._grad_views, strict=True):
            grad = p.grad
            if grad is None:
                view.zero_()
                p.grad = view
            elif grad.data_ptr() != view.data_ptr():  # set outside a backward pass
                view.copy_(grad)
                p.grad = view
