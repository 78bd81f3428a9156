"""Token ids beyond a model's embedding: refused before any work, naming both sizes,
instead of a worker's bare ``IndexError: index out of range in self``."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.trainer.driver.vocabulary import VocabularyError, check_vocabulary
from tests.common.training import TinyLM, next_token_loss


@pytest.fixture(scope="module")
def tokens(client, tmp_path_factory):
    """A byte-tokenizer dataset (257 ids) of rows of 16 tokens; the end-of-text id, 256,
    between its documents."""
    root = tmp_path_factory.mktemp("vocabulary")
    rng = np.random.default_rng(0)
    for i in range(4):
        (root / "corpus" / f"{i}.txt").parent.mkdir(exist_ok=True)
        (root / "corpus" / f"{i}.txt").write_bytes(rng.integers(97, 123, 500, np.uint8)
                                                   .tobytes())
    ds = dt.prepare(root / "corpus", root / "tokens.zarr", seq_len=16, client=client,
                    progress=False)
    assert ds.attrs["stats"]["x"]["max"] == [256]  # the ids the model must embed
    return ds


def _trainer(rows: int) -> dt.Trainer:
    return dt.Trainer(functools.partial(TinyLM, rows), next_token_loss, dt.optim.sgd(0.1),
                      progress=False)


SMALL = (r"{what}: the model's embedding 'embed' has 256 rows, fewer than the 257 ids of the "
         r"tokenizer .* was prepared with \(token ids up to 256\): make the embedding "
         r"nn.Embedding\(257, ...\)")


def test_evaluate_and_predict_name_both_sizes(client, tokens):
    trainer = _trainer(256)
    with pytest.raises(VocabularyError, match=SMALL.format(what="evaluation")) as caught:
        trainer.evaluate(tokens, client=client)
    assert isinstance(caught.value, dt.DasktrainError) and isinstance(caught.value, ValueError)
    with pytest.raises(VocabularyError, match=SMALL.format(what="prediction")):
        trainer.predict(tokens, client=client)


def test_an_embedding_that_holds_the_vocabulary_passes_whatever_else_is_small(client,
                                                                             tokens):
    # The position embedding has 16 rows, far fewer than 257 ids: it reads positions.
    trainer = _trainer(257)
    metrics = trainer.evaluate(tokens, client=client)
    assert np.isfinite(metrics["loss"])
    assert trainer.predict(tokens, client=client).shape == (len(tokens), 16, 257)


def test_a_fit_names_both_sizes_before_any_work_and_leaves_the_model_alone(client, tokens):
    trainer = _trainer(200)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(VocabularyError, match=r"fit: the model's embedding 'embed' has 200 "
                                              r"rows, fewer than the 257 ids"):
        trainer.fit(tokens, epochs=1, client=client)
    assert trainer.model.training  # the probe ran on a copy
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(),
                                                 strict=True))


def test_a_dataset_of_no_tokens_is_not_probed(client, regression):
    trainer = dt.Trainer(lambda: torch.nn.Sequential(torch.nn.Embedding(2, 4)),
                         next_token_loss, dt.optim.sgd(0.1), progress=False)
    called = []
    check_vocabulary(trainer.model, regression, False, lambda *a: called.append(a), "fit")
    assert called == []
