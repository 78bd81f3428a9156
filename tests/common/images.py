"""Small image folders for tests: class sub-folders of JPEG and PNG files, and the direct
Pillow decode every test compares with."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

CLASSES = ("cat", "dog", "eel")


def picture(rng: np.random.Generator, height: int, width: int, kind: int) -> np.ndarray:
    """A smooth RGB picture (stripes whose direction depends on ``kind``) with a little
    noise: resampling differences show as they do on photographs, not as on noise."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    direction = (xx, yy, xx + yy)[kind % 3]
    phase = rng.uniform(0, 2 * np.pi, 3)
    frequency = rng.uniform(0.15, 0.35)
    image = np.stack([128 + 90 * np.sin(frequency * direction + phase[c]) for c in range(3)],
                     axis=-1)
    image += rng.normal(0, 6, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def write_image_folder(root: Path, per_class: int = 8, height: int = 40, width: int = 48,
                       seed: int = 0) -> list[Path]:
    """``root/<class>/<i>.jpg|png``: every third file a PNG. Returns the files, sorted."""
    rng = np.random.default_rng(seed)
    files = []
    for kind, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            path = root / name / f"{i:03d}.{'png' if i % 3 == 0 else 'jpg'}"
            Image.fromarray(picture(rng, height, width, kind)).save(path, quality=92)
            files.append(path)
    return sorted(files)


def pillow_decode(path: Path, size: tuple[int, int] | None = None) -> np.ndarray:
    """The file as a Pillow user reads it: RGB, centre-cropped and resized to ``size``
    (height, width) with ``ImageOps.fit``; (height, width, 3) ``uint8``."""
    with Image.open(path) as image:
        rgb = image.convert("RGB")
        if size is not None and rgb.size != (size[1], size[0]):
            rgb = ImageOps.fit(rgb, (size[1], size[0]), method=Image.Resampling.BILINEAR)
        return np.array(rgb)


def pillow_crop(image: np.ndarray, box: tuple[int, int, int, int], size: tuple[int, int],
                flip: bool) -> np.ndarray:
    """``image`` (height, width, 3) cropped to ``box`` (top, left, height, width), resized
    to ``size`` with Pillow's bilinear filter and mirrored if ``flip``."""
    top, left, h, w = box
    out = Image.fromarray(image).resize((size[1], size[0]), Image.Resampling.BILINEAR,
                                        box=(left, top, left + w, top + h))
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.array(out)


def _png(header: bytes, pixels: bytes, end: bool = True) -> bytes:
    """A PNG file of an IHDR ``header`` and one IDAT chunk of (compressed) ``pixels``."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels)
            + (chunk(b"IEND", b"") if end else b""))


def _png16(path: Path, samples: np.ndarray, color_type: int) -> None:
    """A PNG of 16-bit samples (Pillow writes 16-bit greyscale only): ``samples`` of shape
    (height, width) or (height, width, channels), ``color_type`` 0 (grey), 2 (RGB), 4 (grey
    and alpha) or 6 (RGBA)."""
    height, width = samples.shape[:2]
    rows = b"".join(b"\0" + samples[r].astype(">u2").tobytes() for r in range(height))
    header = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    path.write_bytes(_png(header, zlib.compress(rows)))


def write_every_mode(folder: Path, height: int = 12, width: int = 16) -> dict[Path, np.ndarray]:
    """One file of each Pillow mode an image folder can hold (PNG, JPEG, BMP and WebP; 1-bit,
    grey, grey and alpha, palette with and without transparency, RGB, RGBA, CMYK, and 16-bit
    grey, grey and alpha, RGB and RGBA), all of ``height`` x ``width``, in ``folder``.

    Returns each file's expected RGB pixels (height, width, 3) ``uint8``: Pillow's own
    conversion to RGB for 8-bit files, and the 8-bit picture a 16-bit file was made of
    (each sample times 257, so its high byte is the 8-bit value).
    """
    folder.mkdir(parents=True, exist_ok=True)
    rgb = picture(np.random.default_rng(3), height, width, 2)
    grey = np.asarray(Image.fromarray(rgb).convert("L"))
    alpha = np.linspace(0, 255, height * width, dtype=np.uint8).reshape(height, width)
    pictures = {
        "1": Image.fromarray(grey).convert("1"),
        "L": Image.fromarray(grey),
        "LA": Image.fromarray(np.stack([grey, alpha], axis=-1), "LA"),
        "P": Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=32),
        "RGB": Image.fromarray(rgb),
        "RGBA": Image.fromarray(np.dstack([rgb, alpha]), "RGBA"),
        "CMYK": Image.fromarray(rgb).convert("CMYK"),
    }
    transparent = pictures["P"].copy()
    transparent.info["transparency"] = 0
    files = {
        "png-1.png": pictures["1"], "png-L.png": pictures["L"], "png-LA.png": pictures["LA"],
        "png-P.png": pictures["P"], "png-P-transparent.png": transparent,
        "png-RGB.png": pictures["RGB"], "png-RGBA.png": pictures["RGBA"],
        "jpeg-L.jpg": pictures["L"], "jpeg-RGB.jpg": pictures["RGB"],
        "jpeg-CMYK.jpg": pictures["CMYK"],
        "bmp-1.bmp": pictures["1"], "bmp-L.bmp": pictures["L"], "bmp-P.bmp": pictures["P"],
        "bmp-RGB.bmp": pictures["RGB"], "webp-RGB.webp": pictures["RGB"],
        "webp-RGBA.webp": pictures["RGBA"],
    }
    expected = {}
    for name, image in files.items():
        path = folder / name
        image.save(path, quality=95) if name.endswith(".jpg") else image.save(path)
        with Image.open(path) as written:
            expected[path] = np.array(written.convert("RGB"))
    wide = [("png16-L.png", grey.astype(np.uint16) * 257, 0, np.dstack([grey] * 3)),
            ("png16-LA.png", np.dstack([grey, alpha]).astype(np.uint16) * 257, 4,
             np.dstack([grey] * 3)),
            ("png16-RGB.png", rgb.astype(np.uint16) * 257, 2, rgb),
            ("png16-RGBA.png", np.dstack([rgb, alpha]).astype(np.uint16) * 257, 6, rgb)]
    for name, samples, color_type, want in wide:
        _png16(folder / name, samples, color_type)
        expected[folder / name] = want
    # Pillow's own 16-bit greyscale file too ("I;16", written by Pillow itself)
    Image.fromarray(grey.astype(np.uint16) * 257).save(folder / "png16-I16.png")
    expected[folder / "png16-I16.png"] = np.dstack([grey] * 3)
    return expected


def write_png_header(path: Path, height: int, width: int) -> None:
    """A PNG whose header says ``height`` x ``width`` and whose pixels are cut short: its
    size reads as a real file's does (from the header), and nothing of it decodes."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(_png(header, zlib.compress(b"\0" * 64), end=False))


def float_convnet() -> torch.nn.Module:
    """A small convnet of float32 images (n, 3, H, W) into 3 classes: fails on ``uint8``
    input, as any model without a normalising first layer does."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(4, len(CLASSES)))


def pixels_as_floats(arrays: dict[str, np.ndarray], rng: np.random.Generator
                     ) -> dict[str, np.ndarray]:
    """A transform that is a plain function: ``uint8`` pixels to float32 in [0, 1]."""
    return {**arrays, "image": arrays["image"].astype(np.float32) / 255}
