"""An image folder end to end: shapes drawn as JPEGs, prepared both ways, a small convnet
trained with augmentation on the workers in two update modes.

    .venv/bin/python examples/images.py [--dir runs/images] [--per-class 300] [--epochs 10]

1. Draws a labelled folder (``circle/``, ``cross/``, ``square/``, ``triangle/``: 48x48
   JPEGs of a shape of random size, place and colours on a noisy background).
2. Prepares it twice: ``decoded`` (uint8 32x32 pixels, centre-cropped) and ``encoded`` (the
   JPEG bytes), each split train=0.8,val=0.2 (the same files in both).
3. Trains the same convnet with ``sync`` from the decoded dataset and ``async`` from the
   encoded one (decoded on the workers, then the same augmentation: random resized crop and
   flip). The model normalises its uint8 input itself (``Normalize.module()``), so
   validation reads the stored pixels as they are.
4. Prints validation accuracy per mode and writes ``augmented.png``: a grid of training
   samples as the workers augmented them.

Runs in about a minute on 2 cores with the defaults. With ``--scheduler`` it runs on an
existing cluster instead of the embedded LocalCluster.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from PIL import Image, ImageDraw

import dasktrain as dt
from dasktrain.pipeline.images import (
    ImageTransform,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)

SHAPES = ("circle", "cross", "square", "triangle")
SIDE, SIZE = 48, 32  # drawn, stored and trained at


def draw(shape: str, rng: np.random.Generator) -> Image.Image:
    """A shape of random size, place and colour on a noisy background of another colour."""
    background = rng.integers(0, 256, 3)
    pixels = background + rng.normal(0, 20, (SIDE, SIDE, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    pen = ImageDraw.Draw(image)
    colour = tuple(int(c) for c in (background + rng.integers(80, 176, 3)) % 256)
    r = rng.uniform(9, 17)
    cx, cy = rng.uniform(r + 2, SIDE - r - 2, 2)
    if shape == "circle":
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        pen.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "triangle":
        pen.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=colour)
    else:
        w = r / 3
        pen.rectangle((cx - r, cy - w, cx + r, cy + w), fill=colour)
        pen.rectangle((cx - w, cy - r, cx + w, cy + r), fill=colour)
    return image


def make_folder(root: Path, per_class: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for shape in SHAPES:
        (root / shape).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            draw(shape, rng).save(root / shape / f"{i:04d}.jpg", quality=90)


def convnet() -> torch.nn.Module:
    """uint8 images (n, 3, 32, 32) -> 4 logits; normalises its own input."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        Normalize(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)).module(),
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * (SIZE // 8) ** 2, len(SHAPES)))


def augmentation(encoded: bool) -> ImageTransform:
    """Random resized crop and flip on the workers; an encoded image is first brought to
    the decoded dataset's size the way preparing did (centre crop)."""
    steps = (RandomResizedCrop(SIZE, scale=(0.6, 1.0)), RandomHorizontalFlip())
    return ImageTransform(Resize(SIZE), *steps) if encoded else ImageTransform(*steps)


def save_grid(pipeline: dt.Pipeline, classes: list[str], path: Path) -> None:
    images, labels = next(iter(pipeline))
    pipeline.close()
    figure, axes = plt.subplots(4, 8, figsize=(8, 4.6))
    for ax, image, label in zip(axes.flat, images, labels, strict=False):
        ax.imshow(image.permute(1, 2, 0).numpy())
        ax.set_title(classes[int(label)], fontsize=7)
        ax.axis("off")
    figure.suptitle("training samples as the workers augmented them")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="runs/images", help="folder, datasets and figure")
    parser.add_argument("--per-class", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--scheduler", default=None, help="an existing cluster's address")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.dir)
    client = None
    if args.scheduler:
        from distributed import Client

        client = Client(args.scheduler)
    make_folder(out / "shapes", args.per_class)
    datasets = {}
    for storage in ("decoded", "encoded"):
        started = time.perf_counter()
        datasets[storage] = dt.prepare(
            out / "shapes", out / f"shapes-{storage}.zarr", client=client, progress=False,
            overwrite=True, image_storage=storage, split="train=0.8,val=0.2",
            image_size=SIZE if storage == "decoded" else None)
        print(f"prepared {storage}: {len(datasets[storage])} images in "
              f"{time.perf_counter() - started:.1f}s")
    print(dt.describe(datasets["decoded"]))
    classes = datasets["decoded"].attrs["labels"]["label"]
    validation = datasets["decoded"].split("val")
    for mode, storage in (("sync", "decoded"), ("async", "encoded")):
        trainer = dt.Trainer(convnet, torch.nn.functional.cross_entropy,
                             dt.optim.adam(2e-3), mode=mode, workers=2,
                             batch_size=32, transform=augmentation(storage == "encoded"),
                             progress=False)
        started = time.perf_counter()
        history = trainer.fit(datasets[storage].split("train"), epochs=args.epochs,
                              validation=validation, client=client)
        last = history.epochs[-1]["validation"]
        print(f"{mode:5s} from {storage} storage: val accuracy {last['accuracy']:.1%}, "
              f"val loss {last['loss']:.3f}, {time.perf_counter() - started:.1f}s")
    grid = out / "augmented.png"
    save_grid(dt.Pipeline(datasets["encoded"].split("train"), 32, seed=1, client=client,
                          transform=augmentation(encoded=True)), classes, grid)
    print(f"augmented samples: {grid}")
    if client is not None:
        client.close()


if __name__ == "__main__":
    main()
