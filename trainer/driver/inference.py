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
from dasktrain.datasets.tokenizers import vocabulary_of
from dasktrain.errors import DasktrainError
from dasktrain.pipeline.named import NamedBatch, check_pair_batches
from dasktrain.trainer.worker.compute import BatchCompute, MetricTotals, batch_size_of

__all__ = ["ForwardFunction", "VocabularyError", "check_vocabulary", "compact_copy",
           "computing", "evaluate_on_cluster", "predict_on_cluster"]

ForwardFunction = Callable[[torch.nn.Module, Any], torch.Tensor]


def _ranges(dataset: Dataset, rows: int) -> list[tuple[int, int]]:
    """Blocks of ``rows`` rows aligned with the dataset's chunks where possible."""
    step = max(rows, 1)
    return [(a, min(a + step, dataset.stop)) for a in range(dataset.start, dataset.stop, step)]


def _rows(dataset: Dataset, start: int, stop: int) -> dict[str, np.ndarray]:
    return {n: np.asarray(dataset.zarr_array(n)[start:stop]) for n in dataset.array_names}


def _batch(dataset: Dataset, arrays: dict[str, np.ndarray], as_dict: bool) -> Any:
    """``arrays`` (rows of every array) as one batch shaped as the pipeline delivers it."""
    tensors = {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in arrays.items()}
    if as_dict:
        return NamedBatch(tensors, dataset.roles)
    if dataset.targets_name is None:
        return tensors[dataset.features_name]
    return tensors[dataset.features_name], tensors[dataset.targets_name]


def _batches(dataset: Dataset, start: int, stop: int, batch_size: int, as_dict: bool
             ) -> Any:
    """The rows [start, stop) as batches shaped as the pipeline delivers them."""
    arrays = _rows(dataset, start, stop)
    for a in range(0, stop - start, batch_size):
        yield _batch(dataset, {n: v[a:a + batch_size] for n, v in arrays.items()}, as_dict)


def _forward(model: torch.nn.Module, forward: ForwardFunction | None, batch: Any
             ) -> torch.Tensor:
    """``forward(model, batch)``, else the model on the batch's inputs: ``x`` of a pair,
    the features arrays of a dict batch as keyword arguments."""
    if forward is not None:
        return forward(model, batch)
    if isinstance(batch, NamedBatch):
        return model(**batch.inputs)
    return model(batch[0] if isinstance(batch, tuple) else batch)


def _predict_block(model: torch.nn.Module, forward: ForwardFunction | None,
                   dataset: Dataset, start: int, stop: int, batch_size: int, as_dict: bool,
                   threads: int) -> np.ndarray:
    tune_allocator()
    if threads:
        torch.set_num_threads(threads)
    model.eval()
    outputs = []
    with torch.no_grad():
        for batch in _batches(dataset, start, stop, batch_size, as_dict):
            output = _forward(model, forward, batch)
            outputs.append(output.detach().cpu().numpy())
    return np.concatenate(outputs)


def _evaluate_block(model: torch.nn.Module, compute: BatchCompute, dataset: Dataset,
                    start: int, stop: int, batch_size: int, as_dict: bool,
                    threads: int) -> dict[str, Any]:
    tune_allocator()
    if threads:
        torch.set_num_threads(threads)
    model.eval()
    totals = MetricTotals()
    correct = counted = 0
    with torch.no_grad():
        for batch in _batches(dataset, start, stop, batch_size, as_dict):
            loss, values, pair = compute(model, batch, torch.device("cpu"))
            n = batch_size_of(batch)
            totals.add({"loss": float(loss), **values}, n)
            if pair is not None and pair[1] is not None:
                output, y = pair
                if not y.is_floating_point() and output.ndim == 2:
                    correct += int((output.argmax(dim=1) == y).sum())
                    counted += n
    return {**totals.to_dict(), "correct": correct, "classified": counted}


def check_decoded(dataset: Dataset, what: str) -> None:
    """Refuse a dataset of encoded images: ``what`` (evaluation, prediction) reads the
    arrays as stored, with no transform to decode them."""
    encoded = dataset.encoded_arrays
    if encoded:
        raise ValueError(
            f"{what} reads {dataset!r} as stored, and its array(s) {encoded} hold encoded "
            "images (the files' bytes), which no model takes: use a split prepared with "
            "--image-storage decoded at the model's input size (image_storage='decoded')")


class VocabularyError(DasktrainError, ValueError):
    """A token dataset holds ids beyond the rows of the model's embedding that reads them;
    the message names both sizes."""


class _Planted(Exception):
    """Raised by the probe's hook: ``embedding`` received the planted id."""

    def __init__(self, name: str, rows: int) -> None:
        super().__init__(name, rows)
        self.name, self.rows = name, rows


def computing(compute: BatchCompute) -> Callable[[torch.nn.Module, Any], Any]:
    """``run(model, batch)`` for :func:`check_vocabulary`: the loss and metrics, on CPU."""
    return lambda model, batch: compute(model, batch, torch.device("cpu"))


def check_vocabulary(model: torch.nn.Module, dataset: Dataset, as_dict: bool,
                     run: Callable[[torch.nn.Module, Any], Any], what: str) -> None:
    """Refuse a model whose ``nn.Embedding`` that reads the token ids of ``dataset`` has
    fewer rows than the vocabulary of the tokenizer the dataset was prepared with: the
    worker would fail with a bare ``IndexError: index out of range in self``.

    Which embedding reads the tokens (rather than positions, say) is seen, not guessed:
    where any embedding has fewer rows than the vocabulary, ``run(model, batch)`` runs a
    copy of the model (in eval mode, without gradients) on the dataset's first row with
    its first token set to the highest id, and a hook on each embedding watches for that
    id. Nothing runs for a dataset that is not a token dataset, or a model whose
    embeddings all hold the vocabulary. Any other failure of the run is left to the real
    work to report.

    Raises
    ------
    VocabularyError
        Naming the embedding, its rows, the vocabulary size and ``what`` was asked.
    """
    found = vocabulary_of(dataset)
    if found is None or len(dataset) == 0:
        return
    tokens, vocabulary = found

    def too_small(of: torch.nn.Module) -> dict[str, torch.nn.Embedding]:
        return {name: m for name, m in of.named_modules()
                if isinstance(m, torch.nn.Embedding) and m.num_embeddings < vocabulary}

    if not too_small(model) or tokens not in dataset.array_names:
        return
    probe = compact_copy(model).eval()
    handles = []
    for name, embedding in too_small(probe).items():
        def hook(module: torch.nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            ids = args[0] if args else None
            if isinstance(ids, torch.Tensor) and ids.numel() \
                    and int(ids.max()) == vocabulary - 1:
                raise _Planted(name, module.num_embeddings)

        handles.append(embedding.register_forward_pre_hook(hook))
    arrays = _rows(dataset, dataset.start, dataset.start + 1)
    arrays[tokens] = arrays[tokens].copy()
    arrays[tokens].reshape(-1)[0] = vocabulary - 1  # the highest id the tokenizer makes
    try:
        with torch.no_grad():
            run(probe, _batch(dataset, arrays, as_dict))
    except _Planted as planted:
        raise VocabularyError(
            f"{what}: the model's embedding {planted.name!r} has {planted.rows:,} rows, fewer "
            f"than the {vocabulary:,} ids of the tokenizer {dataset!r} was prepared with "
            f"(token ids up to {vocabulary - 1:,}): make the embedding "
            f"nn.Embedding({vocabulary:,}, ...), e.g. from dt.load_tokenizer(ds).vocab_size"
            ) from None
    except Exception:  # not ours to report: the real work will
        return
    finally:
        for handle in handles:
            handle.remove()


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
                       threads: int) -> da.Array:
    """A lazy dask array of the model's outputs, one block per chunk of ``dataset``, whose
    tasks run on ``client``'s cluster."""
    check_decoded(dataset, "prediction")
    if not as_dict:
        check_pair_batches(dataset)
    check_vocabulary(model, dataset, as_dict,
                     lambda probe, batch: _forward(probe, forward, batch), "prediction")
    first = next(_batches(dataset, dataset.start, dataset.start + 1, 1, as_dict))
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
                                   threads), shape=(b - a, *shape), dtype=dtype)
              for a, b in _ranges(dataset, dataset.chunk_rows)]
    return da.concatenate(blocks) if len(blocks) > 1 else blocks[0]


def evaluate_on_cluster(model: torch.nn.Module, compute: BatchCompute, dataset: Dataset,
                        client: Client, *, batch_size: int, as_dict: bool, threads: int
                        ) -> dict[str, float]:
    """Mean loss and metrics of ``model`` over ``dataset`` (and accuracy where the targets
    are class labels), computed by tasks on the cluster's workers."""
    check_decoded(dataset, "evaluation")
    if not as_dict:
        check_pair_batches(dataset)
    check_vocabulary(model, dataset, as_dict, computing(compute), "evaluation")
    shared = dask.delayed(compact_copy(model), pure=False)
    task = dask.delayed(_evaluate_block, pure=True)
    parts = [task(shared, compute, dataset, a, b, batch_size, as_dict, threads)
             for a, b in _ranges(dataset, dataset.chunk_rows)]
    results = client.compute(parts, sync=True)
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
