"""The steps of an :class:`~dasktrain.pipeline.images.ImageTransform`: random resized crop,
horizontal flip, resize to a fixed size, normalisation; on ``uint8`` torch tensors.

Each step draws its random numbers for a piece's images at once (:meth:`ImageOp.draw`) from
the generator the pipeline seeds per piece, before any image is looked at: what a row
becomes depends on (seed, epoch, group, piece) and its position alone, so a resumed epoch
gives the same images, bit for bit, wherever its tasks run. kornia's augmentation modules
draw from torch's global generator, which every thread of a process shares, so they are
not used for the drawing; the draws follow kornia's (and torchvision's) rules.

Where the work is done:

* crop and resize: torch's bilinear resampling with antialiasing, on ``uint8`` images laid
  out channels-last, which is Pillow's own filter (an image cropped and resized here
  differs from Pillow's result by less than one level on average) and about 33 µs per
  96x96 -> 64x64 image on one core. kornia's ``crop_by_indices`` does not antialias
  (a downscaled crop then aliases: one level on average from Pillow's, up to 22), and
  antialiased (a Gaussian blur first) it costs 600 µs;
* flip: kornia's ``hflip``;
* normalisation: in place on the one float copy the conversion makes (4.6 µs an image;
  kornia's ``normalize`` allocates two more copies, 11 µs); :meth:`Normalize.module` does
  the same as a torch module, to normalise on the model's device instead (kornia's
  ``Normalize`` module takes 33 times as long on a ``uint8`` batch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import kornia
import numpy as np
import torch
import torch.nn.functional as F

from dasktrain.datasets.image_codec import FITS, fit_image, parse_image_size

__all__ = ["ImageOp", "Normalize", "RandomHorizontalFlip", "RandomResizedCrop", "Resize"]

#: Tries a random resized crop makes before it falls back to a centre crop (kornia's and
#: torchvision's number).
_TRIES = 10

Size = int | tuple[int, int]


class ImageOp:
    """One step of an image transform. ``draw`` takes the step's random numbers for ``n``
    images; ``one`` applies the step to image ``i`` (``uint8``, (channels, height, width)).
    """

    #: Whether the step brings every image to one size.
    sizes: ClassVar[bool] = False

    def draw(self, rng: np.random.Generator, n: int) -> Any:
        """The step's random numbers for ``n`` images (None: it draws none)."""
        return None

    def one(self, image: torch.Tensor, drawn: Any, i: int) -> torch.Tensor:
        raise NotImplementedError

    def evaluation(self) -> ImageOp | None:
        """The step's deterministic counterpart for evaluation (None: leave it out); a
        step that draws nothing is its own."""
        return self


def _size(size: Size) -> tuple[int, int]:
    parsed = parse_image_size(size)
    assert parsed is not None
    return parsed


@dataclasses.dataclass(frozen=True, slots=True)
class RandomResizedCrop(ImageOp):
    """A random region of ``scale`` of the image's area and aspect ratio in ``ratio``
    (log-uniform), resized to ``size`` (an int for a square, or (height, width)).

    A region that fits is sought with ten draws; failing that, the largest centred region
    of an aspect ratio within ``ratio`` is taken (the rules of kornia and torchvision).
    """

    size: Size
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    sizes: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _size(self.size)
        low, high = self.scale
        if not 0 < low <= high <= 1:
            raise ValueError(f"scale must satisfy 0 < low <= high <= 1, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < low <= high, got {self.ratio}")

    def draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        """Uniform numbers for the area (``n`` x 10), the log aspect ratio (``n`` x 10) and
        the position (``n`` x 2); :meth:`box` makes a region of them, given the image's
        size, so nothing drawn depends on an image's size."""
        return {"area": rng.random((n, _TRIES)), "ratio": rng.random((n, _TRIES)),
                "where": rng.random((n, 2))}

    def box(self, drawn: dict[str, np.ndarray], i: int, height: int, width: int
            ) -> tuple[int, int, int, int]:
        """Image ``i``'s region: (top, left, height, width) in pixels."""
        # Python floats, not numpy: ten tries of scalars cost microseconds, numpy's calls
        # on arrays of ten several times that.
        low, high = math.log(self.ratio[0]), math.log(self.ratio[1])
        smallest, spread = self.scale[0], self.scale[1] - self.scale[0]
        for u, v in zip(drawn["area"][i].tolist(), drawn["ratio"][i].tolist(), strict=True):
            area = height * width * (smallest + u * spread)
            aspect = math.exp(low + v * (high - low))
            w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < w <= width and 0 < h <= height:
                where = drawn["where"][i]
                return (int(where[0] * (height - h + 1)), int(where[1] * (width - w + 1)),
                        h, w)
        aspect = width / height
        if aspect < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif aspect > self.ratio[1]:
            h, w = height, round(height * self.ratio[1])
        else:
            h, w = height, width
        return (height - h) // 2, (width - w) // 2, h, w

    def one(self, image: torch.Tensor, drawn: Any, i: int) -> torch.Tensor:
        top, left, h, w = self.box(drawn, i, image.shape[1], image.shape[2])
        return _resized(image[:, top:top + h, left:left + w], _size(self.size))

    def evaluation(self) -> ImageOp:
        """The centre of the image at the crop's size: :class:`Resize` (``center-crop``)."""
        return Resize(self.size)


def _resized(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``image`` (channels, height, width) ``uint8`` resized to ``size`` with Pillow's
    antialiased bilinear filter (torch's implementation of it)."""
    if tuple(image.shape[1:]) == size:
        return image
    return F.interpolate(image[None], size=size, mode="bilinear", antialias=True,
                         align_corners=False)[0]


@dataclasses.dataclass(frozen=True, slots=True)
class Resize(ImageOp):
    """Every image brought to ``size`` as a preparation's ``image_fit`` does
    (``center-crop`` or ``stretch``), by the same code: an encoded dataset resized here
    equals the same images prepared decoded at that size."""

    size: Size
    fit: str = "center-crop"
    sizes: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _size(self.size)
        if self.fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {self.fit!r}")

    def one(self, image: torch.Tensor, drawn: Any, i: int) -> torch.Tensor:
        pixels = np.ascontiguousarray(image.permute(1, 2, 0).numpy())
        return torch.from_numpy(fit_image(pixels, _size(self.size), self.fit)).permute(2, 0, 1)


@dataclasses.dataclass(frozen=True, slots=True)
class RandomHorizontalFlip(ImageOp):
    """Mirror each image left to right with probability ``p``."""

    p: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.p <= 1:
            raise ValueError(f"p must lie in [0, 1], got {self.p}")

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Which of ``n`` images are flipped."""
        return rng.random(n) < self.p

    def one(self, image: torch.Tensor, drawn: Any, i: int) -> torch.Tensor:
        return kornia.geometry.transform.hflip(image) if drawn[i] else image

    def evaluation(self) -> None:
        """Left out: images are evaluated as they are."""
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class Normalize(ImageOp):
    """``uint8`` images to ``float32`` ``(pixel / 255 - mean) / std`` per channel (default:
    ImageNet's statistics); the last step of a transform.

    :meth:`of` takes the mean and std a decoded dataset recorded for its pixels.
    """

    mean: Sequence[float] = (0.485, 0.456, 0.406)
    std: Sequence[float] = (0.229, 0.224, 0.225)

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std) or not all(s > 0 for s in self.std):
            raise ValueError(f"mean and std need one value per channel, std > 0; got "
                             f"mean={self.mean}, std={self.std}")

    @classmethod
    def of(cls, dataset: Any, name: str = "image") -> Normalize:
        """The per-channel mean and std a decoded image dataset recorded (``dataset.attrs``)
        for its array ``name``, on the scale of [0, 1]."""
        stats = dataset.attrs["stats"].get(name)
        images = dataset.attrs.get("images") or {}
        if stats is None or images.get("storage") != "decoded":
            raise ValueError(f"{dataset!r} records no pixel statistics of {name!r}: they "
                             "are kept for decoded images; give mean and std")
        return cls(tuple(float(m) / 255 for m in stats["mean"]),
                   tuple(max(float(s), 1e-6) / 255 for s in stats["std"]))

    def _scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``pixel * scale + shift`` is ``(pixel / 255 - mean) / std``: (channels, 1, 1)."""
        scale = torch.tensor([1 / (255 * s) for s in self.std], dtype=torch.float32)
        shift = torch.tensor([-m / s for m, s in zip(self.mean, self.std, strict=True)],
                             dtype=torch.float32)
        return scale[:, None, None], shift[:, None, None]

    def batch(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` (n, channels, height, width) ``uint8``, normalised, as float32."""
        if images.shape[1] != len(self.mean):
            raise ValueError(f"Normalize has {len(self.mean)} channels, the images "
                             f"{images.shape[1]}")
        # One float copy, then in place. kornia's normalize allocates two more copies of
        # the batch: 11 µs an image against 4.6.
        scale, shift = self._scale_shift()
        out = torch.empty(images.shape, dtype=torch.float32, device=images.device)
        out.copy_(images)
        return out.mul_(scale.to(images.device)).add_(shift.to(images.device))

    def module(self) -> torch.nn.Module:
        """The same normalisation as a torch module, for ``uint8`` batches (n, channels,
        height, width): put it first in a model to normalise on the model's device, so
        that the pipeline moves a quarter of the bytes, and ``Trainer.evaluate`` of a
        decoded dataset (stored pixels, no transform) sees what training saw."""
        return _Normalizing(*self._scale_shift())


class _Normalizing(torch.nn.Module):
    """``uint8`` pixels to ``pixel * scale + shift`` in float32, on the module's device.

    kornia's ``Normalize`` module does this to a ``uint8`` batch of 128 x 3 x 64 x 64 in
    8.6 ms on one core; one conversion and two in-place operations take 0.26 ms.
    """

    def __init__(self, scale: torch.Tensor, shift: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale)
        self.register_buffer("shift", shift)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.to(torch.float32).mul_(self.scale).add_(self.shift)
