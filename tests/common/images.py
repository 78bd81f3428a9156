"""Small image folders for tests: class sub-folders of JPEG and PNG files, and the direct
Pillow decode every test compares with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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
