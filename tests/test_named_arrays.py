"""Datasets of several named arrays: an ``.npz`` of an image, metadata and a label (or a
table's column groups) prepared under those names and roles, served as dict batches keyed
by them, and a model of two inputs trained on them, in ``sync`` equal to one process on the
union batch. On the session's real cluster (worker processes), real Zarr stores on disk."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
import torch

import dasktrain as dt
from tests.common.builders import assert_user_error, run_cli
from tests.common.training import flat_parameters, torch_optimizer

ROWS = 256  # 192 train + 64 val: 6 global batches of 32 per epoch, none partial
CLASSES = 4


def _three_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """Images whose mean brightness and metadata whose first value make the class: a
    model needs both inputs to tell all four apart."""
    rng = np.random.default_rng(seed)
    bright = rng.integers(0, 2, ROWS)
    first = rng.integers(0, 2, ROWS)
    image = rng.standard_normal((ROWS, 1, 8, 8)).astype(np.float32) \
        + (bright * 2.0 - 1.0)[:, None, None, None].astype(np.float32)
    metadata = rng.standard_normal((ROWS, 3)).astype(np.float32)
    metadata[:, 0] = (first * 2.0 - 1.0) + 0.3 * metadata[:, 0]
    label = (2 * bright + first).astype(np.int64)
    return {"image": image, "metadata": metadata, "label": label}


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    path = tmp_path_factory.mktemp("named") / "three.npz"
    values = _three_arrays()
    np.savez(path, **values)
    return path, values


@pytest.fixture(scope="module")
def three(client, arrays, tmp_path_factory):
    """Split, with both features arrays normalised on the train split."""
    out = tmp_path_factory.mktemp("named-ds") / "three.zarr"
    return dt.prepare(arrays[0], out, client=client, arrays=["image", "metadata", "label"],
                      split="train=0.75,val=0.25", normalize=True, chunk_rows=64,
                      progress=False)


class ImageAndMetadata(torch.nn.Module):
    """A conv branch for the image, an MLP branch for the metadata, one head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(4 + 8, CLASSES)

    def forward(self, image: torch.Tensor, metadata: torch.Tensor) -> torch.Tensor:
        pooled = torch.relu(self.conv(image)).mean(dim=(2, 3))
        return self.head(torch.cat([pooled, self.mlp(metadata)], dim=1))


def test_npz_arrays_keep_their_names_roles_and_values(client, arrays, tmp_path):
    path, values = arrays
    ds = dt.prepare(path, tmp_path / "a.zarr", client=client, chunk_rows=64, progress=False,
                    arrays=["image", "metadata", "label"])
    assert ds.roles == {"image": "features", "metadata": "features", "label": "targets"}
    assert ds.names_with_role("features") == ["image", "metadata"]
    for name, value in values.items():
        stored = ds[name].compute()
        assert stored.dtype == value.dtype and stored.shape == value.shape, name
        np.testing.assert_array_equal(stored, value)
    # Every member by its own name, or renamed with a role of one's choosing.
    every = dt.prepare(path, tmp_path / "all.zarr", client=client, arrays="all",
                       progress=False)
    assert every.roles == ds.roles
    renamed = dt.prepare(path, tmp_path / "r.zarr", client=client, progress=False,
                         arrays=["img=image", "meta=metadata:other", "label"])
    assert renamed.roles == {"img": "features", "meta": "other", "label": "targets"}
    np.testing.assert_array_equal(renamed["img"].compute(), values["image"])
    assert renamed.attrs["provenance"]["source_details"]["arrays"]["img"] == {
        "from": "image", "role": "features"}


def test_every_features_array_is_normalised_on_train_and_labels_are_kept(client, three,
                                                                         arrays):
    norm = three.attrs["normalization"]
    assert set(norm) == {"image", "metadata"}
    train = three.split("train")
    for name in ("image", "metadata"):
        assert norm[name]["fitted_on"] == "train"
        stored = train[name].compute().astype(np.float64)
        np.testing.assert_allclose(stored.mean(axis=0), 0, atol=1e-5)
        np.testing.assert_allclose(stored.std(axis=0), 1, atol=1e-4)
    labels = three["label"].compute()
    assert labels.dtype == np.int64
    assert sorted(labels.tolist()) == sorted(arrays[1]["label"].tolist())
    # Every array's chunks and statistics check out, and info names each with its role.
    assert dt.verify(three, client=client, progress=False).ok
    shown = dt.describe(three)
    for name, role in three.roles.items():
        assert re.search(rf"^  {name}\s+{role}\s", shown, re.M), shown


def test_dict_batches_are_keyed_by_the_array_names(client, three):
    pipe = dt.Pipeline(three.split("train"), batch_size=32, as_dict=True, client=client)
    try:
        batch = next(iter(pipe))
    finally:
        pipe.close()
    assert isinstance(batch, dt.NamedBatch)
    assert list(batch) == ["image", "metadata", "label"]
    assert batch["image"].shape == (32, 1, 8, 8) and batch["metadata"].shape == (32, 3)
    assert list(batch.inputs) == ["image", "metadata"]
    assert batch.target is batch["label"] and batch.target.dtype == torch.int64
    # (x, y) batches would drop the metadata: refused by name, before any work.
    with pytest.raises(ValueError, match=r"2 features arrays \('image', 'metadata'\).*as_dict"):
        dt.Pipeline(three, batch_size=32, client=client)


def _one_process(dataset, config, batch_size, epochs, client) -> torch.Tensor:
    """Plain torch on the same global batch order, ``batch_size`` samples per step."""
    model = ImageAndMetadata()
    optimizer = torch_optimizer(config, model)
    pipe = dt.Pipeline(dataset, batch_size, seed=0, as_dict=True, client=client)
    try:
        for _ in range(epochs):
            for batch in pipe:
                optimizer.zero_grad()
                output = model(image=batch["image"], metadata=batch["metadata"])
                torch.nn.functional.cross_entropy(output, batch["label"]).backward()
                optimizer.step()
    finally:
        pipe.close()
    return flat_parameters(model)


def test_a_two_input_model_trains_on_dict_batches_and_sync_equals_one_process(client, three):
    train, val = three.split("train"), three.split("val")
    config = dt.optim.sgd(0.1, momentum=0.9)
    trainer = dt.Trainer(ImageAndMetadata, torch.nn.functional.cross_entropy, config, "sync",
                         workers=2, batch_size=16, as_dict=True, progress=False)
    history = trainer.fit(train, epochs=4, validation=val, client=client)
    expected = _one_process(train, config, 32, 4, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5, atol=1e-6)
    # It learned from both inputs: either alone tells at most half of the four classes.
    assert history.epochs[-1]["validation"]["accuracy"] > 0.9
    assert history.epochs[-1]["validation"]["loss"] < history.epochs[0]["validation"]["loss"]
    # predict feeds the model its inputs by name, as the trainer did.
    out = trainer.predict(val, client=client).compute()
    with torch.no_grad():
        direct = trainer.model(image=torch.from_numpy(val["image"].compute()),
                               metadata=torch.from_numpy(val["metadata"].compute())).numpy()
    np.testing.assert_allclose(out, direct, rtol=1e-5, atol=1e-6)


def test_pair_batches_of_several_inputs_are_refused_before_training(client, three):
    trainer = dt.Trainer(ImageAndMetadata, torch.nn.functional.cross_entropy,
                         dt.optim.sgd(0.1), "sync", workers=2, batch_size=16, progress=False)
    with pytest.raises(ValueError, match=r"'image', 'metadata'.*as_dict=True"):
        trainer.fit(three.split("train"), epochs=1, client=client)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    rng = np.random.default_rng(1)
    rows = 120
    df = pd.DataFrame({f"p{i}": rng.standard_normal(rows) for i in range(3)})
    df["age"] = rng.uniform(0, 90, rows)
    df["height"] = rng.uniform(1.4, 2.1, rows)
    df["city"] = rng.choice(["Lima", "Oslo", "Pune"], rows)
    df["label"] = rng.integers(0, 3, rows)
    path = tmp_path_factory.mktemp("named-table") / "t.csv"
    df.to_csv(path, index=False)
    return path, df


def test_table_column_groups_become_arrays_with_their_roles(client, table, tmp_path):
    path, df = table
    ds = dt.prepare(path, tmp_path / "t.zarr", client=client, progress=False,
                    arrays=["pixels=p0,p1,p2", "meta=age,height", "city:other", "label"],
                    encode_categorical=True)
    assert ds.roles == {"pixels": "features", "meta": "features", "city": "other",
                        "label": "targets"}
    np.testing.assert_allclose(ds["pixels"].compute(), df[["p0", "p1", "p2"]].to_numpy(),
                               rtol=1e-6)
    np.testing.assert_allclose(ds["meta"].compute(), df[["age", "height"]].to_numpy(),
                               rtol=1e-6)
    assert ds["label"].dtype == np.int64 and ds["label"].shape == (len(df),)
    np.testing.assert_array_equal(ds["label"].compute(), df["label"].to_numpy())
    # Categories of an "other" column: integer codes, their labels recorded.
    assert ds["city"].dtype == np.int64
    assert ds.attrs["labels"] == {"city": ["Lima", "Oslo", "Pune"]}
    codes = ds["city"].compute()
    assert [ds.attrs["labels"]["city"][c] for c in codes] == df["city"].tolist()


@pytest.mark.parametrize(("source", "choice", "fragments"), [
    ("npz", ["imag", "label"], ["no member 'imag' (for array 'imag')", "'image'"]),
    ("npz", ["image=image,metadata"], ["array 'image' is made of one member"]),
    ("short", ["image", "metadata", "label"], ["mismatched lengths", "'metadata': 255"]),
    ("table", ["a=p0,p1", "b=p1,age"], ["column 'p1' is in two arrays, 'a' and 'b'"]),
    ("table", ["a=p0", "a=p1"], ["array name 'a' given twice"]),
    ("table", ["a=p0:inputs"], ["unknown role 'inputs'", "features, targets, other"]),
    ("table", ["all"], ["'all' works for .npz members"]),
    ("table", ["label:targets"], ["no array has the role 'features'"]),
    ("parabola", ["x"], ["does not choose arrays by name", "arrays= works for .npz"]),
])
def test_bad_choices_name_the_problem_and_leave_nothing(client, arrays, table, tmp_path,
                                                        source, choice, fragments):
    if source == "short":  # one array a row short
        values = {**arrays[1], "metadata": arrays[1]["metadata"][:-1]}
        np.savez(tmp_path / "short.npz", **values)
    path = {"npz": arrays[0], "table": table[0], "short": tmp_path / "short.npz",
            "parabola": "parabola"}[source]
    out = tmp_path / "out.zarr"
    with pytest.raises(ValueError) as caught:
        dt.prepare(path, out, client=client, arrays=choice, progress=False)
    for fragment in fragments:
        assert fragment in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        (["short.npz"] if source == "short" else [])


def test_arrays_and_features_are_one_or_the_other(arrays, tmp_path):
    with pytest.raises(ValueError, match=r"either arrays .* or features/target"):
        dt.prepare(arrays[0], tmp_path / "out.zarr", arrays=["image"], target="label")


def test_the_cli_writes_named_arrays_and_refuses_bad_ones_in_one_line(client, arrays, table,
                                                                      tmp_path):
    out = tmp_path / "cli.zarr"
    done = run_cli("prepare", str(arrays[0]), str(out), "--array", "image", "--array",
                   "meta=metadata", "--array", "label", "--no-progress",
                   "--scheduler", client.scheduler.address)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for name, role in (("image", "features"), ("meta", "features"), ("label", "targets")):
        assert any(line.split()[:2] == [name, role] for line in lines), done.stdout
    bad = tmp_path / "bad.zarr"
    assert_user_error(run_cli("prepare", str(table[0]), str(bad), "--array", "a=p0,p1",
                              "--array", "b=p1"),
                      "column 'p1' is in two arrays, 'a' and 'b'")
    assert_user_error(run_cli("prepare", str(arrays[0]), str(bad), "--array", "imag"),
                      "no member 'imag' (for array 'imag')")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli.zarr"]
