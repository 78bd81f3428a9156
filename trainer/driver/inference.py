"""Prediction and evaluation spread over the cluster: one task per block of rows.

Each task reads its rows straight from the dataset's Zarr arrays on the worker that runs
it and applies the model there, so nothing but the results crosses the network: the
outputs (``predict``, a lazy dask array) or a few sums (``evaluate``). The model travels
once, as one key shared by every task.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import dask
import dask.array as da
import numpy as np
import torch
from distributed import Client

from dasktrain._malloc import tune_allocator
from dasktrain.datasets import Dataset
from dasktrain.pipeline.named import NamedBatch, check_pair_batches
from dasktrain.trainer.driver.rows import ArraysTransform, batches
from dasktrain.trainer.driver.vocabulary import check_vocabulary, computing
from dasktrain.trainer.errors import TrainerError
from dasktrain.trainer.worker.compute import BatchCompute, MetricTotals, batch_size_of
from dasktrain.trainer.worker.loop import pick_device

__all__ = ["ForwardFunction", "compact_copy", "evaluate_on_cluster", "evaluation_transform",
           "inference_device", "predict_on_cluster"]

ForwardFunction = Callable[[torch.nn.Module, Any], torch.Tensor]


def _ranges(dataset: Dataset, rows: int) -> list[tuple[int, int]]:
    """Blocks of ``rows`` rows aligned with the dataset's chunks where possible."""
    step = max(rows, 1)
    return [(a, min(a + step, dataset.stop)) for a in range(dataset.start, dataset.stop, step)]


def _forward(model: torch.nn.Module, forward: ForwardFunction | None, batch: Any
             ) -> torch.Tensor:
    """``forward(model, batch)``, else the model on the batch's inputs: ``x`` of a pair,
    the features arrays of a dict batch as keyword arguments."""
    if forward is not None:
        return forward(model, batch)
    if isinstance(batch, NamedBatch):
        return model(**batch.inputs)
    return model(batch[0] if isinstance(batch, tuple) else batch)


def inference_device(requested: str | None) -> torch.device:
    """Where a prediction or evaluation task computes: the trainer's device, else CUDA
    when this worker sees a GPU. A task on a worker that sees none (they run on any
    worker, the data-loading ones too) computes on the CPU: the same numbers, slower."""
    device = pick_device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return device


def _placed(model: torch.nn.Module, requested: str | None, threads: int
            ) -> tuple[torch.nn.Module, torch.device]:
    """The task's model on its device, in eval mode. A copy goes to a GPU: the one the
    worker holds is shared by every task of this call that runs there."""
    tune_allocator()
    if threads:
        torch.set_num_threads(threads)
    device = inference_device(requested)
    if device.type != "cpu":
        model = copy.deepcopy(model).to(device)
    model.eval()
    return model, device


def _on(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, a pair, a dict batch) with its tensors on ``device``."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, NamedBatch):
        return NamedBatch({n: t.to(device, non_blocking=True) for n, t in batch.items()},
                          batch.roles)
    if isinstance(batch, tuple):
        return tuple(_on(part, device) for part in batch)
    return batch.to(device, non_blocking=True) if isinstance(batch, torch.Tensor) else batch


def _predict_block(model: torch.nn.Module, forward: ForwardFunction | None,
                   dataset: Dataset, start: int, stop: int, batch_size: int, as_dict: bool,
                   threads: int, transform: ArraysTransform | None,
                   device: str | None = None) -> np.ndarray:
    model, where = _placed(model, device, threads)
    outputs = []
    with torch.no_grad():
        for batch in batches(dataset, start, stop, batch_size, as_dict, transform):
            output = _forward(model, forward, _on(batch, where))
            outputs.append(output.detach().cpu().numpy())
    return np.concatenate(outputs)


def _evaluate_block(model: torch.nn.Module, compute: BatchCompute, dataset: Dataset,
                    start: int, stop: int, batch_size: int, as_dict: bool,
                    threads: int, transform: ArraysTransform | None,
                    device: str | None = None) -> dict[str, Any]:
    model, where = _placed(model, device, threads)
    totals = MetricTotals()
    correct = counted = 0
    with torch.no_grad():
        for batch in batches(dataset, start, stop, batch_size, as_dict, transform):
            batch = _on(batch, where)
            loss, values, pair = compute(model, batch, where)
            n = batch_size_of(batch)
            totals.add({"loss": float(loss), **values}, n)
            if pair is not None and pair[1] is not None:
                output, y = pair
                if not y.is_floating_point() and output.ndim == 2:
                    correct += int((output.argmax(dim=1) == y).sum())
                    counted += n
    return {**totals.to_dict(), "correct": correct, "classified": counted}


def evaluation_transform(transform: Any) -> ArraysTransform | None:
    """The deterministic part of a training transform, for evaluation: its
    ``evaluation()`` (an :class:`~dasktrain.pipeline.images.ImageTransform` has one), or
    None where it has none (a function: nothing says which of it is augmentation)."""
    evaluation = getattr(transform, "evaluation", None)
    return evaluation() if callable(evaluation) else None


def check_decoded(dataset: Dataset, what: str, transform: ArraysTransform | None) -> None:
    """Refuse a dataset of encoded images that ``what`` (evaluation, prediction) would read
    as stored, with no transform to decode them."""
    encoded = dataset.encoded_arrays
    if encoded and transform is None:
        raise ValueError(
            f"{what} reads {dataset!r} as stored, and its array(s) {encoded} hold encoded "
            "images (the files' bytes), which no model takes: use a split prepared with "
            "--image-storage decoded at the model's input size (image_storage='decoded'), "
            "or give the Trainer transform=ImageTransform(...), whose evaluation() decodes "
            "them")


def compact_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers own their memory: after a fit they
    are views of the trainer's flat storage, and a view pickles the whole storage with it
    (several times the model, sent with every evaluation)."""
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for tensor in [*clone.parameters(), *clone.buffers()]:
            tensor.data = tensor.data.clone()
    return clone


def predict_on_cluster(model: torch.nn.Module, dataset: Dataset, client: Client, *,
                       batch_size: int, forward: ForwardFunction | None, as_dict: bool,
                       threads: int, transform: ArraysTransform | None = None,
                       device: str | None = None) -> da.Array:
    """A lazy dask array of the model's outputs, one block per chunk of ``dataset`` (each
    after ``transform``, where one is given), whose tasks run on ``client``'s cluster, on
    ``device`` (see :func:`inference_device`)."""
    check_decoded(dataset, "prediction", transform)
    if not as_dict:
        check_pair_batches(dataset)
    check_vocabulary(model, dataset, as_dict,
                     lambda probe, batch: _forward(probe, forward, batch), "prediction")
    first = next(batches(dataset, dataset.start, dataset.start + 1, 1, as_dict, transform))
    model = compact_copy(model)  # put in eval mode and sent: not the caller's
    model.eval()
    with torch.no_grad():
        sample = _forward(model, forward, first)
    shape, dtype = tuple(sample.shape[1:]), sample.detach().cpu().numpy().dtype
    # On the cluster now, as one key every task reads: the model travels there once, not
    # with the graph at every compute; the array holds the future, which keeps it there.
    shared = client.scatter(model, hash=False)
    task = dask.delayed(_predict_block, pure=True)
    blocks = [da.from_delayed(task(shared, forward, dataset, a, b, batch_size, as_dict,
                                   threads, transform, device),
                              shape=(b - a, *shape), dtype=dtype)
              for a, b in _ranges(dataset, dataset.chunk_rows)]
    return da.concatenate(blocks) if len(blocks) > 1 else blocks[0]


def evaluate_on_cluster(model: torch.nn.Module, compute: BatchCompute, dataset: Dataset,
                        client: Client, *, batch_size: int, as_dict: bool, threads: int,
                        transform: ArraysTransform | None = None,
                        device: str | None = None) -> dict[str, float]:
    """Mean loss and metrics of ``model`` over ``dataset`` (each block after
    ``transform``, where one is given), and accuracy where the targets are class labels,
    computed by tasks on the cluster's workers, on ``device`` (see
    :func:`inference_device`).

    Raises
    ------
    TrainerError
        The model failed on images read as stored (no transform): the message says so and
        how to give one.
    """
    check_decoded(dataset, "evaluation", transform)
    if not as_dict:
        check_pair_batches(dataset)
    check_vocabulary(model, dataset, as_dict, computing(compute), "evaluation")
    shared = dask.delayed(compact_copy(model), pure=False)
    task = dask.delayed(_evaluate_block, pure=True)
    parts = [task(shared, compute, dataset, a, b, batch_size, as_dict, threads, transform,
                  device)
             for a, b in _ranges(dataset, dataset.chunk_rows)]
    try:
        results = client.compute(parts, sync=True)
    except Exception as exc:
        if transform is None and dataset.attrs.get("images"):
            raise TrainerError(f"evaluation of {dataset!r} failed: {type(exc).__name__}: "
                               f"{exc}; {_STORED_IMAGES}") from exc
        raise
    totals = MetricTotals()
    correct = classified = 0
    for part in results:
        totals.merge(part)
        correct += part["correct"]
        classified += part["classified"]
    metrics = totals.means()
    if classified and "accuracy" not in metrics:
        metrics["accuracy"] = correct / classified
    return metrics


_STORED_IMAGES = (
    "evaluation (and a fit's validation) read the images as stored, uint8 NCHW, without the "
    "training transform: give the Trainer transform=ImageTransform(...), whose "
    "deterministic part (ImageTransform.evaluation(): crops become a centred Resize, flips "
    "are left out) evaluation then applies, or evaluate(data, transform=...), or a model "
    "that takes uint8 pixels (Normalize.of(ds).module() as its first layer)")
