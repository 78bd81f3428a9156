"""Image files as pixels: decode, check and fit to a size, the same way wherever it runs.

Preparation (decoded storage) and the pipeline (encoded storage, decoded on the workers)
both call these, so an image stored decoded and one decoded at training time are the same
pixels.

Decoding: JPEG through ``simplejpeg`` (libjpeg-turbo), everything else, CMYK JPEGs (told by
their header) and any JPEG that ``simplejpeg`` refuses (data libjpeg flags as corrupt but
Pillow tolerates), through Pillow. Where both decode a file they give the same pixels (both
are libjpeg-turbo with its default DCT and upsampling); ``simplejpeg`` is about 2.5 times
faster on small JPEGs (96x96, about 8 KB: 15,200 against 5,600 images/s on one core here),
which is what decides how fast an encoded dataset trains. Falling back to Pillow means an
image is accepted exactly when Pillow accepts it.

Every image becomes RGB, ``uint8``, shaped (height, width, 3) as the decoders produce it;
callers lay it out as they store it. Greyscale, palette, 1-bit, alpha and CMYK images go
through Pillow's conversion to RGB (alpha dropped). 16-bit samples keep their high byte
(``value >> 8``, the full 0-65535 range onto 0-255): Pillow reads a 16-bit RGB PNG that
way, and its own conversion of 16-bit greyscale (``I;16``) clips every value above 255 to
white instead. Scaling by each image's own range would change an image's contrast with its
content (two exposures of one scene would no longer differ in brightness), so the fixed
scale is kept; a 12-bit image in a 16-bit file comes out darker, as in any 8-bit viewer.
"""

from __future__ import annotations

import io
import re
import warnings

import numpy as np
import simplejpeg
from PIL import Image, ImageOps

from dasktrain.datasets.errors import SourceError

__all__ = [
    "FITS",
    "IMAGE_SUFFIXES",
    "ImageError",
    "check_image",
    "decode_image",
    "fit_image",
    "parse_image_size",
]

#: File suffixes read as images (lower case).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
#: How an image is brought to a fixed size: ``center-crop`` scales it to cover the size
#: and cuts the middle out (aspect kept); ``stretch`` scales each side to the size.
FITS = ("center-crop", "stretch")

_JPEG_MAGIC = b"\xff\xd8"
#: JPEG colour spaces of printing inks, decoded by Pillow (see :func:`decode_image`).
_INK = ("CMYK", "YCCK")
#: Pillow's modes of greyscale samples wider than 8 bits that a PNG can hold: 16-bit
#: samples in either byte order, and "I" (32-bit), in which older Pillow read them.
_WIDE_GREY = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})


class ImageError(SourceError):
    """A file is not an image this library can decode; the message names it."""


def parse_image_size(value: str | int | tuple[int, int] | list[int] | None
                     ) -> tuple[int, int] | None:
    """``64``, ``"64"``, ``"48x64"`` (height x width) or ``(48, 64)`` as (height, width)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"image_size must be N or HxW, got {value!r}")
    if isinstance(value, int):
        size: tuple[int, ...] = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        size = tuple(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*\d+\s*(x\s*\d+\s*)?", value):
        parts = [int(p) for p in value.lower().split("x")]
        size = (parts[0], parts[-1])
    else:
        raise ValueError(f"image_size must be N or HxW (e.g. 64 or 48x64), got {value!r}")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size):
        raise ValueError(f"image_size must be positive, got {value!r}")
    return int(size[0]), int(size[1])


def _pillow(data: bytes, where: str) -> np.ndarray:
    try:
        with warnings.catch_warnings():
            # A huge image is an error below (DecompressionBombError), not a warning.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                return _rgb(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        # OSError covers Pillow's UnidentifiedImageError and truncated files.
        raise ImageError(f"{where} is not a readable image: {_reason(exc)}") from None


def _rgb(image: Image.Image) -> np.ndarray:
    """``image`` as RGB ``uint8`` (height, width, 3), writable; see the module docstring."""
    if image.mode in _WIDE_GREY:
        # uint16 (or int32 for "I") of shape (height, width): the high byte of each sample
        grey = (np.clip(np.asarray(image), 0, 65535) >> 8).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    return np.array(image.convert("RGB"))  # writable, unlike asarray's


def _reason(exc: BaseException) -> str:
    text = str(exc).replace("<_io.BytesIO object", "<bytes").strip()
    if text.startswith("cannot identify image file"):
        return "not an image file Pillow can identify (JPEG, PNG, BMP, WebP)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def decode_image(data: bytes, where: str = "image") -> np.ndarray:
    """The image in ``data`` as RGB ``uint8`` of shape (height, width, 3).

    Raises
    ------
    ImageError
        Naming ``where`` (the file, or the row of a dataset) and why.
    """
    if data[:2] == _JPEG_MAGIC:
        try:
            # 1.5 us against 50 for a 96x96 decode: CMYK goes to Pillow, whose conversion
            # to RGB it is (simplejpeg converts it too, one level off in most pixels)
            if simplejpeg.decode_jpeg_header(data)[2] not in _INK:
                return simplejpeg.decode_jpeg(data, colorspace="RGB")
        except ValueError:
            pass  # Pillow decides: it tolerates what libjpeg only warns about
    return _pillow(data, where)


def check_image(data: bytes, where: str = "image") -> tuple[int, int]:
    """The (height, width) of the image in ``data``, once it is known to decode.

    A JPEG is decoded at 1/8 of its size (libjpeg-turbo's scaled decode still reads every
    byte of the compressed data, so truncated or corrupt data fails here as in a full
    decode), at about half the cost; other images are decoded whole.

    Raises
    ------
    ImageError
        As :func:`decode_image` would.
    """
    if data[:2] == _JPEG_MAGIC:
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            if colorspace not in _INK:
                simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=1, min_width=1,
                                       min_factor=8)
                return int(height), int(width)
        except ValueError:
            pass
    image = _pillow(data, where)
    return int(image.shape[0]), int(image.shape[1])


def fit_image(image: np.ndarray, size: tuple[int, int] | None, fit: str = "center-crop"
              ) -> np.ndarray:
    """``image`` (height, width, 3) brought to ``size`` (height, width) as ``fit`` says,
    with Pillow's antialiased bilinear filter: ``center-crop`` is Pillow's
    ``ImageOps.fit`` (the middle of the image at the aspect of ``size``, scaled),
    ``stretch`` a plain resize. An image already of that size, or a ``size`` of None, is
    returned as it is."""
    if size is None or image.shape[:2] == tuple(size):
        return image
    if fit not in FITS:
        raise ValueError(f"image fit must be one of {FITS}, got {fit!r}")
    pil = Image.fromarray(image)
    target = (size[1], size[0])  # Pillow's sizes are (width, height)
    if fit == "center-crop":
        resized = ImageOps.fit(pil, target, method=Image.Resampling.BILINEAR)
    else:
        resized = pil.resize(target, Image.Resampling.BILINEAR)
    return np.array(resized)  # writable, unlike asarray's
