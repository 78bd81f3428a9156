"""A model's parameters and gradients as one flat float32 buffer each.

The holder and the workers exchange one contiguous buffer per message (one frame on the
wire, no per-tensor overhead). On a worker the model's parameters are re-pointed to views of
one flat tensor and their ``.grad`` to views of another, so "flattening" costs nothing:
backward writes straight into the buffer that is sent, and fresh parameters are loaded with
one copy.

Layout of a payload: the parameters (in ``named_parameters`` order), then the model's
floating-point buffers (batch-norm running statistics...), each flattened.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings

import numpy as np
import torch

__all__ = ["FlatLayout", "FlatModel"]


@dataclasses.dataclass(frozen=True, slots=True)
class FlatLayout:
    """Names and shapes of what a payload carries, in order."""

    params: tuple[tuple[str, tuple[int, ...]], ...]
    buffers: tuple[tuple[str, tuple[int, ...]], ...]

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
        return sum(int(np.prod(s)) for _, s in self.params)

    @property
    def num_buffers(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.buffers)

    @property
    def size(self) -> int:
        """Elements in a payload."""
        return self.num_params + self.num_buffers

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
    """A module whose parameters (and gradients) live in flat buffers.

    Parameters
    ----------
    model
        The module; its parameters are re-pointed in place.
    device
        Where the model runs. On CUDA the outgoing gradients are staged in pinned host
        memory and copied without blocking.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.model = model.to(self.device)
        self.layout = FlatLayout.of(model)
        params = [p for _, p in model.named_parameters() if p.requires_grad]
        self._buffers = [b for _, b in model.named_buffers() if b.is_floating_point()]
        n = self.layout.num_params
        pinned = self.device.type == "cuda"
        # The outgoing payload: gradients then buffers. On CPU the gradients live in it (no
        # copy to send); on CUDA it is pinned host memory the gradients are copied into.
        self._host = torch.zeros(self.layout.size, dtype=torch.float32, pin_memory=pinned)
        self.params = torch.empty(n, dtype=torch.float32, device=self.device)
        self.grads = (self._host[:n] if self.device.type == "cpu" else
                      torch.zeros(n, dtype=torch.float32, device=self.device))
        offset = 0
        for p in params:
            k = p.numel()
            # Views of the flat buffers: backward accumulates into .grad in place.
            self.params[offset:offset + k].copy_(p.detach().reshape(-1))
            p.data = self.params[offset:offset + k].view_as(p)
            p.grad = self.grads[offset:offset + k].view_as(p)
            offset += k

    def payload(self) -> np.ndarray:
        """Gradients then buffers, as one contiguous float32 host array (reused: send it
        before the next backward)."""
        if self.device.type != "cpu":
            self._host[: self.layout.num_params].copy_(self.grads, non_blocking=True)
        self._gather_buffers(self._host, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return self._host.numpy()

    def state(self) -> np.ndarray:
        """Parameters then buffers, as a new float32 host array."""
        out = torch.empty(self.layout.size, dtype=torch.float32)
        out[: self.layout.num_params].copy_(self.params)
        self._gather_buffers(out, non_blocking=False)
        return out.numpy()

    def _gather_buffers(self, out: torch.Tensor, non_blocking: bool) -> None:
        """Copy the floating-point buffers into ``out`` after the parameters' part."""
        offset = self.layout.num_params
        for b in self._buffers:
            k = b.numel()
            out[offset:offset + k].copy_(b.detach().reshape(-1), non_blocking=non_blocking)
            offset += k

    def load(self, values: np.ndarray) -> None:
        """Take parameters then buffers from a payload-shaped array."""
        if values.shape != (self.layout.size,):
            raise ValueError(f"expected {self.layout.size} values, got {values.shape}")
        with warnings.catch_warnings():
            # Received buffers may be read-only; they are only read here.
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(np.ascontiguousarray(values))
        n = self.layout.num_params
        with torch.no_grad():
            self.params.copy_(source[:n], non_blocking=True)
            offset = n
            for b in self._buffers:
                k = b.numel()
                b.copy_(source[offset:offset + k].view_as(b), non_blocking=True)
                offset += k

    def zero_grad(self) -> None:
        self.grads.zero_()
