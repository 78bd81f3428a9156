"""W-images: a folder of JPEGs fed at the model's speed, against what a PyTorch user runs.

Data: 20,000 JPEGs of 96x96 (about 8 KB each) in 10 class sub-folders, generated once per
run into a temporary directory. Every loader yields the same work per image: decode,
random resized crop to 64x64, horizontal flip, to float; batches of 128.

1. baseline: an ImageFolder-style torch ``Dataset`` (Pillow decode, the crop and flip with
   Pillow, ``torch.from_numpy(...).float() / 255``) through
   ``torch.utils.data.DataLoader(num_workers=2, batch_size=128, shuffle=True)``;
2. dasktrain: the folder prepared once each way (``decoded``: uint8 96x96 pixels;
   ``encoded``: the JPEG bytes), then ``dt.Pipeline(ds, 128, transform=ImageTransform(
   RandomResizedCrop(64), RandomHorizontalFlip(), Normalize(0, 1)))`` with its default
   settings (the workers send ``uint8``, the floats are made on the consumer's fetch
   thread), on a LocalCluster of 2 single-threaded worker processes; beside it: the floats
   made on the workers (``normalize_on="workers"``), ``uint8`` batches made floats in the
   loop by ``Normalize.module()`` as a model's first layer would on its device (its time is
   the loop's, not waiting), and ``--prefetch N``.

Measured as a new user meets them: a fresh loader (or pipeline), its first epoch, the first
batch included. Without a step: images/s. With a simulated 30 ms step per batch
(``time.sleep``, the CPU left free as an accelerator would): the stall (time waiting for
the next batch / epoch wall time) and images/s. And the preparation rate, images/s both
ways (``dt.prepare`` on the running cluster). Each cell is the median of ``--repeats``
epochs (3 by default), the loaders taking turns: an epoch of a few seconds on 2 shared
cores varies by a few tens of milliseconds from one run to the next.

Run: ``.venv/bin/python benchmarks/images.py`` (``--quick``: 1,024 images, one epoch each,
for tests).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import simplejpeg
import torch
from distributed import Client, LocalCluster
from PIL import Image

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD
from dasktrain.cli.bench import Ratio, parse_with_quick, ratio_of, write_ratios
from dasktrain.pipeline.images import (
    ImageTransform,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
)

IMAGES, SIDE, CROP, BATCH, STEP_S, CLASSES = 20_000, 96, 64, 128, 0.030, 10
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
QUICK = {"images": 1_024, "repeats": 1}
# The goals (2 cores): with no step, decoded storage at 2x the DataLoader; with the
# 30 ms step, decoded storage stalls at most 2 % and encoded storage matches the DataLoader.
GOALS = {"no step": "≥ 2x DataLoader", "stall": "≤ 2 % stall", "encoded": "≥ 1.0x DataLoader"}


# -- the data --------------------------------------------------------------------------------
def make_folder(root: Path, count: int, seed: int = 0) -> float:
    """``count`` JPEGs of 96x96 in 10 class folders; returns their mean size in bytes.

    Smooth colour waves plus noise, at quality 85: about 8 KB each, like small photos.
    Noise comes from a bank of fields, shifted per image (drawing 27,648 normal numbers
    per image would take most of the time).
    """
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32)
    bank = rng.normal(0, 16, (8, 2 * SIDE, 2 * SIDE, 3)).astype(np.float32)
    total = 0
    for c in range(CLASSES):
        (root / f"class{c:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        f, phase = rng.uniform(0.03, 0.25, 3), rng.uniform(0, 2 * np.pi, 3)
        waves = np.stack([127 + 90 * np.sin(f[k] * xx + f[(k + 1) % 3] * yy + phase[k])
                          for k in range(3)], axis=-1)
        a, b = rng.integers(0, SIDE, 2)
        image = np.clip(waves + bank[i % 8, a:a + SIDE, b:b + SIDE], 0, 255).astype(np.uint8)
        data = simplejpeg.encode_jpeg(image, quality=85)
        (root / f"class{i % CLASSES:02d}" / f"{i:06d}.jpg").write_bytes(data)
        total += len(data)
    return total / count


# -- the baseline: what a PyTorch user writes --------------------------------------------------
class ImageFolderDataset(torch.utils.data.Dataset):
    """torchvision's ImageFolder and its RandomResizedCrop/RandomHorizontalFlip/ToTensor,
    written with Pillow (torchvision's CPU wheels do not install beside this torch)."""

    def __init__(self, root: Path, crop: int = CROP) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.samples = [(str(f), k) for k, c in enumerate(classes)
                        for f in sorted((root / c).iterdir())]
        self.crop = crop

    def __len__(self) -> int:
        return len(self.samples)

    @staticmethod
    def crop_box(width: int, height: int) -> tuple[int, int, int, int]:
        """torchvision's ``RandomResizedCrop.get_params``: (left, top, right, bottom)."""
        area = width * height
        for _ in range(10):
            target = area * random.uniform(*SCALE)
            aspect = math.exp(random.uniform(math.log(RATIO[0]), math.log(RATIO[1])))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top, left = random.randint(0, height - h), random.randint(0, width - w)
                return left, top, left + w, top + h
        return 0, 0, width, height

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with Image.open(path) as image:
            rgb = image.convert("RGB")
        out = rgb.resize((self.crop, self.crop), Image.Resampling.BILINEAR,
                         box=self.crop_box(*rgb.size))
        if random.random() < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.asarray(out).copy()).permute(2, 0, 1)
        return pixels.float().div_(255), label


def dataloader(root: Path) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ImageFolderDataset(root), batch_size=BATCH,
                                       shuffle=True, num_workers=2)


# -- the loop ----------------------------------------------------------------------------------
def epoch(make: Callable[[], Iterable], step_s: float,
          first_layer: Callable[[torch.Tensor], torch.Tensor] | None = None
          ) -> tuple[float, float, int]:
    """A fresh loader's first epoch, the first batch included: (stall, images/s, images).

    ``first_layer`` (the tuned way: ``uint8`` batches from the workers, a quarter of the
    bytes to move) makes floats of a batch as a model's first layer would on its device:
    its time is the loop's, not time spent waiting for data.
    """
    start = time.perf_counter()
    batches = make()
    waited, images = 0.0, 0
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            x, _ = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - t0
        if first_layer is not None:
            x = first_layer(x)
        assert x.dtype == torch.float32 and x.shape[1:] == (3, CROP, CROP)
        images += len(x)
        if step_s:
            time.sleep(step_s)
    wall = time.perf_counter() - start
    if hasattr(batches, "close"):
        batches.close()
    return waited / wall, images / wall, images


TO_FLOAT = Normalize(mean=(0, 0, 0), std=(1, 1, 1))  # floats in [0, 1], as ToTensor's


def augment(floats: bool = True, normalize_on: str = "consumer") -> ImageTransform:
    """The same work as the baseline's: crop, flip, and (``floats``) floats in [0, 1]."""
    steps = (RandomResizedCrop(CROP, scale=SCALE, ratio=RATIO), RandomHorizontalFlip())
    return ImageTransform(*steps, TO_FLOAT, normalize_on=normalize_on) if floats \
        else ImageTransform(*steps)


def pipeline(ds: dt.Dataset, client: Client, floats: bool = True,
             normalize_on: str = "consumer", **options: int) -> dt.Pipeline:
    return dt.Pipeline(ds, BATCH, seed=0, transform=augment(floats, normalize_on),
                       client=client, **options)


def settle(client: Client, timeout: float = 60.0) -> None:
    """Wait until the cluster runs nothing (a closed pipeline's head start into an epoch
    that never comes still finishes its running tasks)."""
    deadline = time.monotonic() + timeout
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.05)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=IMAGES,
                        help=f"JPEGs in the folder (default {IMAGES:,}, the workload's)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="epochs per cell, the loaders taking turns; the median is shown")
    parser.add_argument("--prefetch", type=int,
                        help="also measure pipelines with this prefetch (tuned beside)")
    args = parse_with_quick(parser, argv, QUICK,
                            "seconds, not minutes: 1,024 images, one epoch each (rough figures)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    runs: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="dasktrain-images-") as tmp:
        folder = Path(tmp) / "folder"
        started = time.perf_counter()
        mean_bytes = make_folder(folder, args.images)
        made = time.perf_counter() - started
        with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                          host="127.0.0.1", **NO_DASHBOARD) as cluster, \
                Client(cluster) as client:
            prepared, rates = {}, {}
            for storage in ("decoded", "encoded"):
                started = time.perf_counter()
                prepared[storage] = dt.prepare(folder, Path(tmp) / f"{storage}.zarr",
                                               client=client, progress=False,
                                               image_storage=storage)
                rates[storage] = args.images / (time.perf_counter() - started)
            to_float = TO_FLOAT.module()
            options = [("default settings", {}),
                       ("floats made on the workers (normalize_on='workers')",
                        {"normalize_on": "workers"}),
                       ("uint8 batches, floats by the model's first layer", {"floats": False})]
            if args.prefetch:
                options.append((f"prefetch={args.prefetch}", {"prefetch": args.prefetch}))
            for _ in range(args.repeats):
                for step, step_s in (("no step", 0.0), ("30 ms step", STEP_S)):
                    runs.setdefault(("torch DataLoader, num_workers=2", step), []).append(
                        epoch(lambda: dataloader(folder), step_s))
                    for storage, ds in prepared.items():
                        for label, kwargs in options:
                            settle(client)
                            runs.setdefault((f"dasktrain {storage}, {label}", step), []).append(
                                epoch(lambda ds=ds, kwargs=kwargs: pipeline(ds, client,
                                                                            **kwargs),
                                      step_s, None if kwargs.get("floats", True) else to_float))
    for name, results in runs.items():
        assert all(r[2] == args.images for r in results), (name, results)
    rows = {name: (float(np.median([r[0] for r in results])),
                   float(np.median([r[1] for r in results])), args.images)
            for name, results in runs.items()}
    print(f"W-images: {args.images:,} JPEGs of {SIDE}x{SIDE} (mean {mean_bytes / 1e3:.1f} KB, "
          f"made in {made:.0f} s), decode + random resized crop to {CROP}x{CROP} + flip + "
          f"float, batches of {BATCH}; {args.workers} worker processes; first epoch of a "
          f"fresh loader, first batch included; median of {args.repeats} epoch(s) per cell; "
          f"{os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print()
    print(f"preparation: decoded {rates['decoded']:,.0f} images/s, "
          f"encoded {rates['encoded']:,.0f} images/s")
    print()
    baseline = {step: rows[("torch DataLoader, num_workers=2", step)]
                for step in ("no step", "30 ms step")}
    print("| loader | images/s, no step | vs DataLoader | stall, 30 ms step | "
          "images/s, 30 ms step | vs DataLoader |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in dict.fromkeys(n for n, _ in rows):
        free, stepped = rows[(name, "no step")], rows[(name, "30 ms step")]
        print(f"| {name} | {free[1]:,.0f} | {free[1] / baseline['no step'][1]:.2f}x | "
              f"{stepped[0]:.1%} | {stepped[1]:,.0f} | "
              f"{stepped[1] / baseline['30 ms step'][1]:.2f}x |")
    print(f"\nthe step alone allows {BATCH / STEP_S:,.0f} images/s")
    flags = ["--quick"] if args.quick else [] if args.images == IMAGES \
        else [f"--images {args.images}"]
    if args.prefetch:
        flags.append(f"--prefetch {args.prefetch}")
    if not args.quick and args.repeats != 3:
        flags.append(f"--repeats {args.repeats}")
    print("command: .venv/bin/python benchmarks/images.py " + " ".join(flags))
    if args.ratios_json:
        write_ratios(args.ratios_json, ratios(rows, rates, baseline))


def ratios(rows: dict, rates: dict[str, float], baseline: dict) -> list[Ratio]:
    """The summary rows of ``dasktrain bench``."""
    loader = "(DataLoader, num_workers=2)"
    decoded, encoded = "dasktrain decoded, default settings", \
        "dasktrain encoded, default settings"
    free, stall, enc = (rows[(decoded, "no step")], rows[(decoded, "30 ms step")],
                        rows[(encoded, "30 ms step")])
    return [
        Ratio(workload="images/s, no step, decoded storage", ours=f"{free[1]:,.0f}",
              baseline=f"{baseline['no step'][1]:,.0f} {loader}",
              ratio=ratio_of(free[1], baseline["no step"][1]), goal=GOALS["no step"]),
        Ratio(workload="stall, 30 ms step, decoded storage", ours=f"{stall[0]:.1%}",
              baseline=f"{baseline['30 ms step'][0]:.1%} {loader}",
              ratio=ratio_of(stall[0], baseline["30 ms step"][0]), goal=GOALS["stall"]),
        Ratio(workload="images/s, 30 ms step, encoded storage", ours=f"{enc[1]:,.0f}",
              baseline=f"{baseline['30 ms step'][1]:,.0f} {loader}",
              ratio=ratio_of(enc[1], baseline["30 ms step"][1]), goal=GOALS["encoded"]),
        Ratio(workload="preparation, images/s (decoded / encoded)",
              ours=f"{rates['decoded']:,.0f} / {rates['encoded']:,.0f}", baseline="—",
              ratio=None),
    ]


if __name__ == "__main__":
    main()
