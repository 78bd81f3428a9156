"""The size decoded images are stored at when none is given, and what that size will cost.

The default is the median size of a sample of the files, read from their headers (Pillow
reads a file's size without decoding it): one image far larger or smaller than the rest
(the first file of a folder, say) no longer sets every image's size. Files of the sample
far from that size are named in a warning, since each will be scaled to it. Before any
work, the stored size is estimated; a default size that would make a very large dataset
is refused, naming the flags that choose another (a size given on purpose is kept).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import fsspec
import numpy as np
from PIL import Image

from dasktrain.datasets.errors import SourceError
from dasktrain.datasets.sizes import human_bytes

__all__ = ["DEFAULT_SIZE_LIMIT", "SAMPLE_FILES", "ImageSizeWarning", "SizeChoice",
           "check_estimate", "median_size"]

#: Files whose headers are read to choose the default size, spread over the listing.
SAMPLE_FILES = 64
#: A file of the sample whose area is this many times the median's, or its inverse, is an
#: outlier: scaled by more than 4x in each direction.
_OUTLIER_AREA = 16.0
#: The largest dataset a default size may make (decoded pixels, before compression);
#: beyond it the size must be chosen.
DEFAULT_SIZE_LIMIT = 16 * 2**30


class ImageSizeWarning(UserWarning):
    """Images of a folder differ widely in size from the size they are stored at."""


@dataclasses.dataclass(frozen=True, slots=True)
class SizeChoice:
    """The default size of decoded images and how it was chosen."""

    size: tuple[int, int]
    """(height, width): the size of the sampled file of median area."""
    sampled: int
    """Files whose headers were read."""

    @property
    def how(self) -> str:
        return f"the median size of {self.sampled:,} sampled files"


def _header_size(file: str) -> tuple[int, int]:
    """(height, width) from the file's header; reads a few KB, decodes nothing."""
    with warnings.catch_warnings():
        # A huge image is said by the estimate (and refused when decoded), not warned of
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with fsspec.open(file, "rb") as handle, Image.open(handle) as image:
            width, height = image.size
    return int(height), int(width)


def median_size(files: Sequence[str], skip_bad: bool, hint: str) -> SizeChoice:
    """The size of median area among up to :data:`SAMPLE_FILES` files spread evenly over
    ``files``, with a warning naming the sampled files far from it.

    A file whose header cannot be read fails here (``hint`` says how to go on), unless
    ``skip_bad``: then it is left out of the sample (the build's check names it).
    """
    picks = np.unique(np.linspace(0, len(files) - 1, min(SAMPLE_FILES, len(files)))
                      .round().astype(int))
    sizes: list[tuple[tuple[int, int], str]] = []
    for i in picks:
        try:
            sizes.append((_header_size(files[i]), files[i]))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            if not skip_bad:
                raise SourceError(f"{files[i]} is not a readable image: {exc}; {hint}"
                                  ) from None
    if not sizes:
        raise SourceError(f"none of the {len(picks):,} sampled files is a readable image; "
                          "give --image-size")
    by_area = sorted(sizes, key=lambda found: (found[0][0] * found[0][1], found[0]))
    choice = SizeChoice(by_area[(len(by_area) - 1) // 2][0], len(sizes))
    _warn_outliers(choice, by_area)
    return choice


def _warn_outliers(choice: SizeChoice, by_area: list[tuple[tuple[int, int], str]]) -> None:
    area = choice.size[0] * choice.size[1]
    far = [(size, file) for size, file in by_area
           if not 1 / _OUTLIER_AREA <= size[0] * size[1] / area <= _OUTLIER_AREA]
    if not far:
        return
    shown = ", ".join(f"{file} ({size[0]}x{size[1]})" for size, file in far[-3:])
    warnings.warn(
        f"{len(far):,} of {len(by_area):,} sampled images are far from the size they are "
        f"stored at, {choice.size[0]}x{choice.size[1]} ({choice.how}), and are scaled to it: "
        f"{shown}; give --image-size to choose the size", ImageSizeWarning, stacklevel=3)


def check_estimate(count: int, size: tuple[int, int], chosen: SizeChoice | None) -> str:
    """What ``count`` images decoded at ``size`` take, said in a phrase; refused when the
    size is the default (``chosen``) and the dataset would pass
    :data:`DEFAULT_SIZE_LIMIT`."""
    total = count * 3 * size[0] * size[1]
    said = (f"decoded at {size[0]}x{size[1]}"
            + (f", {chosen.how} (--image-size sets it)" if chosen is not None else "")
            + f": {human_bytes(3 * size[0] * size[1])} an image, "
              f"{human_bytes(total)} for {count:,}")
    if chosen is not None and total > DEFAULT_SIZE_LIMIT:
        raise SourceError(
            f"images {said}, more than {human_bytes(DEFAULT_SIZE_LIMIT)}: give --image-size "
            f"to choose their size (e.g. --image-size 256, or --image-size "
            f"{size[0]}x{size[1]} to keep this one), or --image-storage encoded to store the "
            "files' bytes")
    return said
