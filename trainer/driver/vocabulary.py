"""Token ids against a model's embedding: a model whose embedding has fewer rows than the
vocabulary of the tokenizer a dataset was prepared with is refused by name, before any
work, instead of failing on a worker with a bare ``IndexError: index out of range in
self``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from dasktrain.datasets import Dataset
from dasktrain.datasets.tokenizers import vocabulary_of
from dasktrain.errors import DasktrainError
from dasktrain.trainer.driver.rows import as_batch, read_rows
from dasktrain.trainer.worker.compute import BatchCompute

__all__ = ["VocabularyError", "check_vocabulary", "computing"]


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
    probe = copy.deepcopy(model).eval()
    handles = []
    for name, embedding in too_small(probe).items():
        def hook(module: torch.nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            ids = args[0] if args else None
            if isinstance(ids, torch.Tensor) and ids.numel() \
                    and int(ids.max()) == vocabulary - 1:
                raise _Planted(name, module.num_embeddings)

        handles.append(embedding.register_forward_pre_hook(hook))
    arrays = read_rows(dataset, dataset.start, dataset.start + 1)
    arrays[tokens] = arrays[tokens].copy()
    arrays[tokens].reshape(-1)[0] = vocabulary - 1  # the highest id the tokenizer makes
    try:
        with torch.no_grad():
            run(probe, as_batch(dataset, arrays, as_dict))
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
