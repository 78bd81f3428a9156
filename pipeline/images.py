"""Image datasets in the pipeline: decoding and augmentation on the workers.

:class:`ImageTransform` is a pipeline ``transform``: it takes a piece's rows of an image
dataset (decoded ``uint8`` NCHW, or the files' bytes of an encoded one, which it decodes
first) and applies its steps in order::

    import dasktrain as dt
    from dasktrain.pipeline.images import (ImageTransform, Normalize, RandomHorizontalFlip,
                                           RandomResizedCrop)

    augment = ImageTransform(RandomResizedCrop(64, scale=(0.35, 1)), RandomHorizontalFlip(),
                             Normalize())
    pipe = dt.Pipeline(ds.split("train"), 128, transform=augment)

Steps up to the last one that fixes the size run image by image (an encoded image is
decoded, cropped and resized before the next is decoded: memory holds one decoded image,
not a piece of them); :class:`Normalize`, which makes floats, runs last on the batch. The
result is NCHW (``uint8``, or ``float32`` after :class:`Normalize`).

In a :class:`~dasktrain.Pipeline`, :class:`Normalize` runs on the consumer by default
(``normalize_on="consumer"``): the workers send ``uint8`` batches, a quarter of the bytes,
and the floats are made on the fetch thread (or on the accelerator after the copy), as
:mod:`dasktrain.pipeline.finish` explains; the batches are the same either way.

Every random number is drawn from the generator the pipeline seeds per piece, before any
image is touched (see :mod:`dasktrain.pipeline.image_ops`): epochs stay exactly
reproducible and a resumed run gets the same images.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from dasktrain.datasets.image_codec import decode_image
from dasktrain.pipeline.image_ops import (
    ImageOp,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)

__all__ = ["ImageOp", "ImageTransform", "Normalize", "RandomHorizontalFlip",
           "RandomResizedCrop", "Resize"]


class ImageTransform:
    """A pipeline transform of the images of array ``image`` (the other arrays pass
    through): decode (an encoded dataset), then ``steps`` in order.

    Parameters
    ----------
    *steps
        :class:`RandomResizedCrop`, :class:`Resize`, :class:`RandomHorizontalFlip`, and
        :class:`Normalize` last. Without a step that fixes the size, the images must all
        be of one size already (a decoded dataset is).
    image
        The name of the images' array.
    normalize_on
        Where a pipeline runs a last :class:`Normalize`: ``"consumer"`` (the default: the
        workers send ``uint8``) or ``"workers"`` (they send ``float32``, four times the
        bytes; for a consumer with no CPU time to spare). Called directly, the transform
        always normalises.
    """

    def __init__(self, *steps: ImageOp, image: str = "image",
                 normalize_on: str = "consumer") -> None:
        if normalize_on not in ("consumer", "workers"):
            raise ValueError(f"normalize_on must be 'consumer' or 'workers', got "
                             f"{normalize_on!r}")
        for step in steps:
            if not isinstance(step, ImageOp):
                raise TypeError(f"steps must be image steps (RandomResizedCrop, Resize, "
                                f"RandomHorizontalFlip, Normalize), got {step!r}")
        if any(isinstance(s, Normalize) for s in steps[:-1]):
            raise ValueError("Normalize makes floats of the pixels: give it last")
        self.steps = tuple(steps)
        self.image = image
        self.normalize_on = normalize_on

    def __repr__(self) -> str:
        return (f"ImageTransform({', '.join(map(repr, self.steps))}, image={self.image!r}, "
                f"normalize_on={self.normalize_on!r})")

    def evaluation(self) -> ImageTransform:
        """The transform's deterministic part, for evaluation and validation: each step's
        counterpart (:meth:`ImageOp.evaluation`): a random resized crop becomes a centred
        :class:`Resize` to its size, a flip is left out, :class:`Resize` and
        :class:`Normalize` stay. ``Trainer.evaluate`` (and a fit's validation) applies it
        where the trainer's ``transform`` is an ``ImageTransform``."""
        steps = [s.evaluation() for s in self.steps]
        return ImageTransform(*[s for s in steps if s is not None], image=self.image,
                              normalize_on="workers")

    def consumer_split(self) -> tuple[ImageTransform, _NormalizeBatch | None]:
        """What the workers run and what the consumer runs after (see
        :mod:`dasktrain.pipeline.finish`): a last :class:`Normalize` on the consumer."""
        last = self.steps[-1] if self.steps else None
        if self.normalize_on != "consumer" or not isinstance(last, Normalize):
            return self, None
        workers = ImageTransform(*self.steps[:-1], image=self.image, normalize_on="workers")
        return workers, _NormalizeBatch(last, self.image)

    def __dask_tokenize__(self) -> Any:
        return ("ImageTransform", repr(self))

    def __call__(self, arrays: dict[str, np.ndarray], rng: np.random.Generator
                 ) -> dict[str, np.ndarray]:
        if self.image not in arrays:
            raise KeyError(f"ImageTransform: no array {self.image!r} among {list(arrays)}; "
                           "give image=NAME")
        images = arrays[self.image]
        n = len(images)
        # Every step's numbers first, in step order: nothing drawn depends on an image.
        drawn = [step.draw(rng, n) for step in self.steps]
        last = self.steps[-1] if self.steps else None
        normalize = last if isinstance(last, Normalize) else None
        per_image = self.steps[:-1] if normalize is not None else self.steps
        out = self._images(images, per_image, drawn)
        if normalize is not None:
            out = normalize.batch(out)
        arrays[self.image] = out.numpy()
        return arrays

    def _images(self, images: np.ndarray, steps: tuple[ImageOp, ...], drawn: list[Any]
                ) -> torch.Tensor:
        """The images after ``steps``, one by one, as one ``uint8`` NCHW tensor."""
        encoded = images.dtype == object
        if not encoded and (images.dtype != np.uint8 or images.ndim != 4):
            raise TypeError(f"ImageTransform takes uint8 images (n, channels, height, width) "
                            f"or encoded ones; array {self.image!r} is {images.dtype} of "
                            f"shape {images.shape}")
        if not encoded and not steps:
            return torch.from_numpy(np.ascontiguousarray(images))
        if not encoded and any(s.sizes for s in steps):
            # torch's uint8 resampling is fastest on channels-last images (about 30 %).
            source = torch.from_numpy(images).contiguous(memory_format=torch.channels_last)
        else:
            source = torch.from_numpy(images) if not encoded else None
        out: torch.Tensor | None = None
        for i in range(len(images)):
            if source is not None:
                image = source[i]
            else:
                # (H, W, 3) as decoded, seen as (3, H, W) without a copy
                image = torch.from_numpy(decode_image(images[i], f"encoded image {i} of "
                                                                 "the piece")).permute(2, 0, 1)
            # ``steps`` is a prefix of self.steps: their draws line up
            for step, numbers in zip(steps, drawn, strict=False):
                image = step.one(image, numbers, i)
            if out is None:
                out = torch.empty((len(images), *image.shape), dtype=torch.uint8)
            elif image.shape != out.shape[1:]:
                raise ValueError(
                    f"ImageTransform: images of different sizes ({tuple(out.shape[1:])} and "
                    f"{tuple(image.shape)}) cannot make a batch; start the steps with "
                    "RandomResizedCrop or Resize")
            out[i] = image
        assert out is not None, "a piece holds rows"
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class _NormalizeBatch:
    """:class:`Normalize` of a batch's images where the batch arrives (a pipeline's
    ``finish``): the same operation on the same ``uint8`` pixels as on a worker."""

    normalize: Normalize
    image: str

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**tensors, self.image: self.normalize.batch(tensors[self.image])}
