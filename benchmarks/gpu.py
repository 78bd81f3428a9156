"""W10 and W11, on a GPU: does the pipeline keep a GPU fed, and what does the holder cost?

W10, feeding a GPU. A generated folder of ``--images`` JPEGs (50,000 by default, 192x192,
about 15 KB each, 10 class sub-folders), random resized crop to 160x160 (scale 0.08-1,
torchvision's) and a horizontal flip, ImageNet normalisation; ResNet-18 (torchvision, 10
classes) in ``channels_last`` under bf16 autocast, SGD momentum 0.9, batches of 256, on the
GPU. Side by side in one run, each a fresh loader's first epoch, the first batch included:

* the ceiling: the same training step on one batch already on the GPU, repeated;
* ``torch.utils.data.DataLoader(num_workers=14, pin_memory=True, persistent_workers=True)``
  over an ImageFolder-style dataset (Pillow decode, the crop and flip with Pillow, floats as
  ``ToTensor`` makes them; normalised on the GPU);
* dasktrain's ``Pipeline(ds, 256, transform=ImageTransform(RandomResizedCrop(160),
  RandomHorizontalFlip(), Normalize()), device="cuda")`` at its defaults (the workers send
  ``uint8``, the floats are made on the GPU after the copy), over the folder prepared once
  as ``encoded`` (the JPEG bytes) and once as ``decoded`` (pixels), on a LocalCluster of 14
  single-threaded worker processes.

Reported: images/s; the GPU's busy fraction (CUDA events around each step, summed, over the
epoch's wall time); the stall (time waiting for the next batch over the wall time). And the
14 cores' limit: images/s of 14 processes doing only the per-image work of each storage
(decode + crop + flip for encoded, crop + flip for decoded), so that a loader below the
ceiling can be said to be bound by the processors or not.

W11, what the holder costs a GPU run. ``Trainer(workers=1, mode="sync")`` against a plain
PyTorch loop of the same model, optimizer and data on the GPU: ResNet-18 and ResNet-50
(torchvision, 10 classes), SGD momentum 0.9 and Adam, ``--w11-batch`` images of 192x192 per
step (a prepared ``decoded`` dataset of ``uint8`` pixels; the model's first layer makes the
floats), ``--precision`` (bf16 autocast by default, as a GPU user runs it). The plain loop
trains on batches already on the GPU (its best case); the Trainer reads them through its
pipeline. Figures: samples/s of the Trainer's last epoch (its History) against the plain
loop's steady steps; where a Trainer step goes: forward and backward, waiting on the holder
(the exchange), waiting on data. Beside it, the same Trainer with ``mode="average"`` at its
defaults: with one replica it takes the same steps as ``sync`` (its optimizer on the replica's
device, the holder sent the parameters and the optimizer's state every ``average_every``
steps).

After the W11 table, where a ``sync`` step of one replica goes: each part timed alone in
this process with the library's own pieces (forward and backward; the gradient to the host;
the reply copied on the host; the holder's step on the processor; the parameters onto the
device), and beside them the parts the candidates would put in their place (the copy from
pinned memory; the optimizer's step on the device).

Run on a machine with a GPU: ``python benchmarks/gpu.py`` (``--only w10``, ``w11`` or
``parts``;
``--quick``: a few hundred images and a small network on the CPU, to check the plumbing).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F
from distributed import Client, LocalCluster

# W6's baseline at this crop: torchvision's ImageFolder and transforms written with Pillow
# (this script's directory, that of benchmarks/images.py, is on sys.path).
from images import RATIO, SCALE, ImageFolderDataset

import dasktrain as dt
from dasktrain._cluster import NO_DASHBOARD
from dasktrain.cli.bench import parse_with_quick
from dasktrain.pipeline.images import (
    ImageTransform,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
)

SIDE, CROP, BATCH, CLASSES, W11_BATCH = 192, 160, 256, 10, 128
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
QUICK = {"images": 384, "workers": 2, "device": "cpu", "model": "tiny", "w11_steps": 4,
         "w11_batch": 16, "ceiling_steps": 4, "w11_repeats": 3}


# -- the data --------------------------------------------------------------------------------
def _write_part(job: tuple[Path, int, int, int]) -> int:
    """JPEGs ``first`` to ``first + count`` (smooth colour waves plus noise from a bank of
    shifted fields, quality 85); returns their bytes."""
    root, first, count, seed = job
    rng = np.random.default_rng(seed + first)
    yy, xx = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32)
    bank = rng.normal(0, 14, (4, 2 * SIDE, 2 * SIDE, 3)).astype(np.float32)
    total = 0
    for i in range(first, first + count):
        label = i % CLASSES
        f = rng.uniform(0.02, 0.12, 3)
        phase = rng.uniform(0, 2 * np.pi, 3)
        waves = np.stack([128 + 80 * np.sin(f[c] * (xx + (label + 1) * 0.3 * yy) + phase[c])
                          for c in range(3)], axis=-1)
        dy, dx = rng.integers(0, SIDE, 2)
        noisy = waves + bank[i % 4, dy:dy + SIDE, dx:dx + SIDE]
        data = simplejpeg.encode_jpeg(np.clip(noisy, 0, 255).astype(np.uint8), quality=85)
        (root / f"c{label}" / f"{i:06d}.jpg").write_bytes(data)
        total += len(data)
    return total


def make_folder(root: Path, count: int, seed: int = 0) -> float:
    """``count`` JPEGs of SIDE x SIDE in 10 class folders, written by one process per
    core; returns their mean size in bytes."""
    for c in range(CLASSES):
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
    parts = max(1, min(os.cpu_count() or 1, count // 64))
    step = -(-count // parts)
    jobs = [(root, a, min(step, count - a), seed) for a in range(0, count, step)]
    with multiprocessing.get_context("spawn").Pool(parts) as pool:
        return sum(pool.map(_write_part, jobs)) / count


# -- the models and the step -----------------------------------------------------------------
class Tiny(torch.nn.Module):
    """A small network for ``--quick`` (torchvision may be missing on a CPU machine)."""

    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=4)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def network(name: str) -> torch.nn.Module:
    if name == "tiny":
        return Tiny()
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)(num_classes=CLASSES)


class Pixels(torch.nn.Module):
    """``uint8`` NCHW pixels in, ImageNet-normalised floats into ``body``: the first layer
    a model of stored pixels has, on its device."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body
        self.register_buffer("mean", MEAN * 255)
        self.register_buffer("std", STD * 255)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body((x.float() - self.mean) / self.std)


def pixels_model(name: str) -> Callable[[], torch.nn.Module]:
    return lambda: Pixels(network(name))


class Stepper:
    """One training step (bf16 autocast, channels_last, cross-entropy, the optimizer), with
    CUDA events around it so that the GPU's busy time can be summed afterwards."""

    def __init__(self, model: torch.nn.Module, device: torch.device, precision: str,
                 optimizer: str = "sgd", channels_last: bool = True) -> None:
        self.device = device
        self.memory = torch.channels_last if channels_last else torch.contiguous_format
        self.model = model.to(device, memory_format=self.memory)
        self.optimizer = (torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
                          if optimizer == "sgd" else
                          torch.optim.Adam(self.model.parameters(), lr=1e-3))
        self.precision = precision
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.cuda = device.type == "cuda"

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
        x = x.to(self.device, non_blocking=True).contiguous(memory_format=self.memory)
        y = y.to(self.device, non_blocking=True)
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) \
            if self.precision == "bf16" else contextlib.nullcontext()
        with autocast:
            loss = F.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.cuda:
            end.record()
            self.events.append((start, end))

    def busy_s(self) -> float:
        """GPU seconds of the steps so far (0 on the CPU); waits for them to finish."""
        if not self.cuda:
            return 0.0
        torch.cuda.synchronize(self.device)
        busy = sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        self.events.clear()
        return busy

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def normalised(x: torch.Tensor) -> torch.Tensor:
    """Floats in [0, 1] (``ToTensor``'s) to ImageNet-normalised ones, on their device."""
    return (x - MEAN.to(x.device)) / STD.to(x.device)


# -- W10: the loaders ------------------------------------------------------------------------
def dataloader(root: Path, workers: int, pin: bool) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ImageFolderDataset(root, CROP), batch_size=BATCH,
                                       shuffle=True, num_workers=workers, pin_memory=pin,
                                       persistent_workers=True, drop_last=False)


def augment() -> ImageTransform:
    return ImageTransform(RandomResizedCrop(CROP, scale=SCALE, ratio=RATIO),
                          RandomHorizontalFlip(), Normalize())


def epoch(make: Callable[[], Iterable], step: Stepper,
          prepare: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """A fresh loader's first epoch, the first batch included: images/s, the GPU's busy
    fraction and the stall."""
    step.synchronize()
    step.busy_s()
    start = time.perf_counter()
    batches = make()
    waited, images = 0.0, 0
    it: Iterator = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - t0
        if prepare is not None:
            x = prepare(x.to(step.device, non_blocking=True))
        step(x, y)
        images += len(y)
    busy = step.busy_s()  # waits for the last step
    wall = time.perf_counter() - start
    with contextlib.suppress(Exception):
        batches.close()
    return {"images/s": images / wall, "busy": busy / wall, "stall": waited / wall,
            "images": images, "wall_s": wall}


def ceiling(step: Stepper, steps: int) -> dict[str, float]:
    """The step alone, on one batch already on the GPU: the most any loader can give."""
    x = torch.rand(BATCH, 3, CROP, CROP, device=step.device)
    x = normalised(x)
    y = torch.randint(0, CLASSES, (BATCH,), device=step.device)
    for _ in range(5):
        step(x, y)
    step.busy_s()
    start = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    busy = step.busy_s()
    wall = time.perf_counter() - start
    return {"images/s": steps * BATCH / wall, "busy": busy / wall, "stall": 0.0,
            "images": steps * BATCH, "wall_s": wall}


def _decode_rate(job: tuple[list[bytes], bool, int]) -> float:
    """Images/s of one process doing a loader's per-image work: decode (``encoded``),
    random resized crop, flip."""
    files, encoded, seed = job
    torch.set_num_threads(1)
    transform = ImageTransform(RandomResizedCrop(CROP, scale=SCALE, ratio=RATIO),
                               RandomHorizontalFlip())
    rng = np.random.default_rng(seed)
    if encoded:
        images = np.empty(len(files), dtype=object)
        images[:] = files
    else:
        images = np.stack([simplejpeg.decode_jpeg(f) for f in files]).transpose(0, 3, 1, 2)
    start = time.perf_counter()
    for a in range(0, len(files), 32):
        transform({"image": images[a:a + 32]}, rng)
    return len(files) / (time.perf_counter() - start)


def core_limit(folder: Path, processes: int, per_process: int = 384) -> dict[str, float]:
    """The per-image work's images/s on ``processes`` cores at once, per storage."""
    files = sorted(folder.glob("*/*.jpg"))[:per_process]
    data = [f.read_bytes() for f in files]
    limits = {}
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        for storage in ("encoded", "decoded"):
            rates = pool.map(_decode_rate, [(data, storage == "encoded", s)
                                            for s in range(processes)])
            limits[storage] = float(sum(rates))
    return limits


def w10(args: argparse.Namespace, tmp: Path, client: Client, device: torch.device) -> None:
    folder = tmp / "folder"
    started = time.perf_counter()
    mean_bytes = make_folder(folder, args.images)
    made = time.perf_counter() - started
    limits = core_limit(folder, args.workers)
    prepared, rates = {}, {}
    for storage in ("encoded", "decoded"):
        started = time.perf_counter()
        prepared[storage] = dt.prepare(folder, tmp / f"{storage}.zarr", client=client,
                                       progress=False, image_storage=storage)
        rates[storage] = args.images / (time.perf_counter() - started)
    step = Stepper(network(args.model), device, "bf16")
    rows = {"ceiling: the step on a batch already on the GPU": ceiling(step, args.ceiling_steps)}
    pin = device.type == "cuda"
    rows[f"torch DataLoader, num_workers={args.workers}, pin_memory={pin}"] = epoch(
        lambda: dataloader(folder, args.workers, pin), step, normalised)
    tunings = [("default settings", {})] + [(f"prefetch={n}", {"prefetch": n})
                                             for n in args.prefetch]
    for storage, ds in prepared.items():
        for label, options in tunings:
            rows[f"dasktrain {storage}, {label}"] = epoch(
                lambda ds=ds, options=options: dt.Pipeline(
                    ds, BATCH, seed=0, transform=augment(), device=device, client=client,
                    **options), step)
    print(f"W10: {args.images:,} JPEGs of {SIDE}x{SIDE} (mean {mean_bytes / 1e3:.1f} KB, made "
          f"in {made:.0f} s), random resized crop to {CROP}x{CROP} + flip + normalise, "
          f"{args.model} in channels_last under bf16 autocast, SGD momentum, batches of "
          f"{BATCH}; {args.workers} loader processes; {device_name(device)}; "
          f"{os.cpu_count()} CPUs; first epoch of a fresh loader, first batch included")
    print(f"preparation ({args.workers} Dask workers): encoded {rates['encoded']:,.0f} "
          f"images/s, decoded {rates['decoded']:,.0f} images/s")
    print(f"the {args.workers} cores' limit for the per-image work alone: encoded (decode, "
          f"crop, flip) {limits['encoded']:,.0f} images/s, decoded (crop, flip) "
          f"{limits['decoded']:,.0f} images/s")
    print()
    top = rows["ceiling: the step on a batch already on the GPU"]["images/s"]
    loader = next(v for k, v in rows.items() if k.startswith("torch DataLoader"))["images/s"]
    print("| loader | images/s | vs ceiling | vs DataLoader | GPU busy | stall |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['images/s']:,.0f} | {row['images/s'] / top:.2f} | "
              f"{row['images/s'] / loader:.2f}x | {row['busy']:.0%} | {row['stall']:.0%} |")
    bound = min(top, limits["decoded"])
    decoded = rows["dasktrain decoded, default settings"]["images/s"]
    print(f"\ndecoded against the lower of the ceiling and the cores' limit "
          f"({'ceiling' if top <= limits['decoded'] else 'cores'}, {bound:,.0f} images/s): "
          f"{decoded / bound:.2f} (goal ≥ 0.9); encoded against the DataLoader: "
          f"{rows['dasktrain encoded, default settings']['images/s'] / loader:.2f}x "
          f"(goal ≥ 1.0x)\n", flush=True)


# -- W11: the holder's cost ------------------------------------------------------------------
def plain_loop(name: str, optimizer: str, data: list[tuple[torch.Tensor, torch.Tensor]],
               device: torch.device, precision: str, steps: int) -> float:
    """Samples/s of a plain loop over batches already on the device (after 5 warm-up
    steps)."""
    step = Stepper(pixels_model(name)(), device, precision, optimizer, channels_last=False)
    batches = [(x.to(device), y.to(device)) for x, y in data]
    for i in range(5):
        step(*batches[i % len(batches)])
    step.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(*batches[i % len(batches)])
    step.synchronize()
    return steps * len(batches[0][1]) / (time.perf_counter() - start)


def optimizer_config(optimizer: str) -> dt.optim.OptimizerConfig:
    """W11's optimizers, as :class:`Stepper` builds them for the plain loop."""
    return dt.optim.sgd(0.05, momentum=0.9) if optimizer == "sgd" else dt.optim.adam(1e-3)


def trainer_run(name: str, optimizer: str, ds: dt.Dataset, client: Client, device: torch.device,
                precision: str, batch: int, epochs: int, mode: str = "sync"
                ) -> dict[str, float]:
    config = optimizer_config(optimizer)
    trainer = dt.Trainer(pixels_model(name), F.cross_entropy, config, mode, workers=1,
                         batch_size=batch, device=str(device), precision=precision,
                         progress=False)
    history = trainer.fit(ds, epochs=epochs, client=client)
    last = history.epochs[-1]
    worker = last["per_worker"][0]
    wall = last["wall_s"]
    return {"samples/s": last["samples_per_s"], "compute": worker["compute_s"] / wall,
            "exchange": worker["exchange_s"] / wall, "stall": worker["stall"],
            "via": ",".join(f"{k}" for k in last["exchange_via"]),
            "transport": str(worker.get("transport"))}


def w11(args: argparse.Namespace, tmp: Path, client: Client, device: torch.device) -> None:
    rows_needed = args.w11_batch * args.w11_steps
    folder = tmp / "w11-folder"
    make_folder(folder, rows_needed, seed=1)
    ds = dt.prepare(folder, tmp / "w11.zarr", client=client, progress=False,
                    image_storage="decoded")
    data = list(dt.Pipeline(ds, args.w11_batch, seed=0, client=client))
    models = w11_models(args)
    print(f"W11: Trainer(workers=1, mode='sync') against a plain loop, {args.w11_batch} images "
          f"of {SIDE}x{SIDE} per step (uint8, made floats by the model's first layer), "
          f"{args.precision} precision, {device_name(device)}; Trainer: its last of "
          f"{args.w11_epochs} epochs of {args.w11_steps} steps (History); plain loop: "
          f"{args.w11_steps} steps on batches already on the device, after 5 warm-up steps")
    print()
    print("| model | optimizer | plain loop, samples/s | Trainer, samples/s | ratio | "
          "Trainer: compute | exchange | data wait | via | `average`, samples/s | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for name in models:
        params = sum(p.numel() for p in network(name).parameters())
        for optimizer in ("sgd", "adam"):
            plain = plain_loop(name, optimizer, data, device, args.precision, args.w11_steps)
            ours = trainer_run(name, optimizer, ds, client, device, args.precision,
                               args.w11_batch, args.w11_epochs)
            local = trainer_run(name, optimizer, ds, client, device, args.precision,
                                args.w11_batch, args.w11_epochs, mode="average")
            print(f"| {name} ({params / 1e6:.1f} M) | {optimizer} | {plain:,.0f} | "
                  f"{ours['samples/s']:,.0f} | {ours['samples/s'] / plain:.2f} | "
                  f"{ours['compute']:.0%} | {ours['exchange']:.0%} | {ours['stall']:.0%} | "
                  f"{ours['via']} ({ours['transport']}) | {local['samples/s']:,.0f} | "
                  f"{local['samples/s'] / plain:.2f} |", flush=True)
    print()
    print_step_parts(args, device, models)


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn`` (after one call not counted), the device's work
    finished before each clock is read."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


STEP_PARTS = ("forward and backward", "gradient to the host", "reply copied on the host",
              "holder's step, processor", "parameters to the device", "same, from pinned",
              "the step on the device")


def where_a_step_goes(name: str, optimizer: str, device: torch.device, precision: str,
                      batch: int, repeats: int) -> dict[str, float]:
    """Milliseconds of each part of a ``sync`` step of one replica in the holder's process
    (the gradient handed over in process, the holder's leased reply copied into the
    replica's receive buffer, then onto the device), each timed alone with the library's
    own pieces: the replica's flat model (:class:`FlatModel`), the holder's arithmetic
    (:class:`Arithmetic`, on the processor as in a fit); and what the candidates would put
    in their place (the copy onto the device from pinned memory, the optimizer on the
    device)."""
    from dasktrain.trainer.flat import FlatModel
    from dasktrain.trainer.holder.arithmetic import Arithmetic
    from dasktrain.trainer.holder.mean import as_tensor
    from dasktrain.trainer.optim.flat import FlatOptimizer
    from dasktrain.trainer.worker.compute import BatchCompute

    config = optimizer_config(optimizer)
    flat = FlatModel(pixels_model(name)(), device)
    x = torch.randint(0, 256, (batch, 3, SIDE, SIDE), dtype=torch.uint8, device=device)
    y = torch.randint(0, CLASSES, (batch,), device=device)
    compute = BatchCompute(F.cross_entropy, precision=precision)

    def forward_backward() -> None:
        flat.zero_grad()
        loss, _, _ = compute(flat.model, (x, y), device)
        loss.backward()
        flat.gradients_done()

    parts = {"forward and backward": _median_ms(forward_backward, device, repeats)}
    payload = flat.payload()
    parts["gradient to the host"] = _median_ms(flat.payload, device, repeats)
    host = np.empty_like(payload)
    parts["reply copied on the host"] = _median_ms(lambda: np.copyto(host, payload),
                                                   device, repeats)
    holder = Arithmetic(flat.layout, flat.state(), config, total_steps=None)
    try:
        gradient = as_tensor(host)
        parts["holder's step, processor"] = _median_ms(lambda: holder.step(gradient),
                                                       device, repeats)
        reply = holder.flat.numpy().copy()
    finally:
        holder.close()
    parts["parameters to the device"] = _median_ms(lambda: flat.load(reply), device,
                                                   repeats)
    pinned = torch.empty(len(reply), dtype=torch.float32,
                         pin_memory=device.type == "cuda").numpy()
    np.copyto(pinned, reply)
    parts["same, from pinned"] = _median_ms(lambda: flat.load(pinned), device, repeats)
    on_device = FlatOptimizer(config, flat.params, flat.layout.param_segments())
    parts["the step on the device"] = _median_ms(lambda: on_device.step(flat.grads), device,
                                                 repeats)
    return parts


def print_step_parts(args: argparse.Namespace, device: torch.device, models: list[str]) -> None:
    print(f"Where a sync step of one replica goes, ms (medians of {args.w11_repeats}, each "
          f"part alone, {args.w11_batch} images, {args.precision}): today a step is the "
          f"first five parts; the holder's update on the device would leave the first and "
          f"the last")
    print()
    print("| model | optimizer | " + " | ".join(STEP_PARTS) + " | today | on the device |")
    print("|---|---|" + "---:|" * (len(STEP_PARTS) + 2))
    for name in models:
        for optimizer in ("sgd", "adam"):
            parts = where_a_step_goes(name, optimizer, device, args.precision,
                                      args.w11_batch, args.w11_repeats)
            today = sum(parts[k] for k in STEP_PARTS[:5])
            there = parts["forward and backward"] + parts["the step on the device"]
            print(f"| {name} | {optimizer} | "
                  + " | ".join(f"{parts[k]:.1f}" for k in STEP_PARTS)
                  + f" | {today:.1f} | {there:.1f} |", flush=True)
    print()


def w11_models(args: argparse.Namespace) -> list[str]:
    return ["tiny"] if args.model == "tiny" else ["resnet18", "resnet50"]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"CPU (torch {torch.__version__})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["w10", "w11", "parts"],
                        help="one workload only (parts: W11's parts of a step alone)")
    parser.add_argument("--images", type=int, default=50_000)
    parser.add_argument("--workers", type=int, default=14,
                        help="Dask worker processes, and the DataLoader's num_workers")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="resnet18", help="W10's network (torchvision)")
    parser.add_argument("--ceiling-steps", type=int, default=30)
    parser.add_argument("--prefetch", type=int, nargs="*", default=[],
                        help="W10: also pipelines with these prefetch depths (tuned, beside)")
    parser.add_argument("--precision", choices=["32", "bf16"], default="bf16",
                        help="W11's precision")
    parser.add_argument("--w11-batch", type=int, default=W11_BATCH)
    parser.add_argument("--w11-steps", type=int, default=16, help="steps per W11 epoch")
    parser.add_argument("--w11-epochs", type=int, default=3)
    parser.add_argument("--w11-repeats", type=int, default=20,
                        help="timings of each part of a step (medians)")
    return parse_with_quick(parser, argv, QUICK,
                            "seconds: a few hundred images and a small network on the CPU")


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py: this machine has no CUDA GPU (--device cpu "
                         "--quick checks the plumbing)")
    torch.backends.cudnn.benchmark = True
    if args.only == "parts":  # no cluster: each part is timed in this process
        print_step_parts(args, device, w11_models(args))
        return
    with tempfile.TemporaryDirectory(prefix="dasktrain-gpu-") as tmp, \
            LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                         host="127.0.0.1", **NO_DASHBOARD) as cluster, \
            Client(cluster) as client:
        if args.only in (None, "w10"):
            w10(args, Path(tmp), client, device)
        if args.only in (None, "w11"):
            w11(args, Path(tmp), client, device)


if __name__ == "__main__":
    main()
