"""Image folders end to end: a folder of class sub-folders (and a manifest) prepared both
ways on the session's real cluster, served by the pipeline with augmentation on the
workers, and every batch held to a direct Pillow decode of the same files with the same
crop parameters. Bad files are refused by name or skipped with a count."""

from __future__ import annotations

import io
import itertools
import pickle
from pathlib import Path

import dask
import numpy as np
import pandas as pd
import pytest
import torch
from distributed import Client, LocalCluster
from PIL import Image

import dasktrain as dt
from dasktrain.datasets.build_tasks import task_reader
from dasktrain.datasets.cleaning import CleaningWarning
from dasktrain.datasets.sources.base import SourceOptions
from dasktrain.datasets.sources.image_sizes import ImageSizeWarning
from dasktrain.datasets.sources.images import ImageSource
from dasktrain.pipeline.images import (
    ImageTransform,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)
from tests.common.builders import assert_user_error, run_benchmark_quick, run_cli, run_cli_batch
from tests.common.images import (
    CLASSES,
    float_convnet,
    picture,
    pillow_crop,
    pillow_decode,
    pixels_as_floats,
    write_every_mode,
    write_image_folder,
    write_png_header,
)

SIZE = (32, 32)  # stored size of the decoded dataset (the files are 40 x 48)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("images") / "folder"
    return root, write_image_folder(root)


@pytest.fixture(scope="module")
def prepared(client, folder, tmp_path_factory) -> dict[str, dt.Dataset]:
    """The folder both ways, in chunks of 5 rows (several blocks for the pipeline)."""
    root, _ = folder
    out = tmp_path_factory.mktemp("prepared")
    return {
        "decoded": dt.prepare(root, out / "decoded.zarr", client=client, progress=False,
                              image_size=32, chunk_rows=5),
        "encoded": dt.prepare(root, out / "encoded.zarr", client=client, progress=False,
                              image_storage="encoded", chunk_rows=5),
    }


def _files_of(encoded: dt.Dataset, files: list[Path]) -> list[Path]:
    """The file each row of an encoded dataset holds: its bytes are the file's."""
    by_bytes = {f.read_bytes(): f for f in files}
    return [by_bytes[bytes(b)] for b in encoded.zarr_array("image")[:]]


def test_a_class_folder_is_prepared_both_ways_with_its_class_names(client, folder, prepared):
    _, files = folder
    decoded, encoded = prepared["decoded"], prepared["encoded"]
    for ds in (decoded, encoded):
        assert ds.attrs["labels"] == {"label": list(CLASSES)}
        assert len(ds) == len(files) and ds.features_name == "image"
        assert dt.verify(ds, client=client, progress=False).ok
    assert decoded.attrs["arrays"]["image"] == {"role": "features", "dtype": "uint8",
                                                "shape": [len(files), 3, *SIZE]}
    assert encoded.attrs["arrays"]["image"]["dtype"] == "object"
    assert decoded.attrs["images"]["storage"] == "decoded"
    assert encoded.attrs["images"]["storage"] == "encoded"
    # Stored in a random order (a folder lists one class after the other).
    rows = _files_of(encoded, files)
    assert sorted(rows) == files and rows != files
    labels = encoded.zarr_array("label")[:]
    assert [CLASSES[k] for k in labels] == [f.parent.name for f in rows]
    np.testing.assert_array_equal(decoded.zarr_array("label")[:], labels)
    # Per-channel statistics of the pixels, exact.
    pixels = decoded.zarr_array("image")[:].astype(np.float64)
    np.testing.assert_allclose(decoded.attrs["stats"]["image"]["mean"],
                               pixels.mean(axis=(0, 2, 3)))
    assert "3 classes: cat, dog, eel" in dt.describe(decoded)


def test_info_says_what_an_encoded_image_is_not_its_zarr_dtype(prepared):
    text = dt.describe(prepared["encoded"])
    assert "object" not in text
    assert "  image    features  encoded  shape=(24,)" in text
    assert ("images    encoded JPEG/PNG/BMP/WebP (the files' bytes, each image its own size), "
            "decoded to H x W x 3 uint8 by the pipeline's ImageTransform") in text
    sizes = prepared["encoded"].attrs["stats"]["image"]
    assert f"image: file sizes mean {sizes['mean'] / 1024:.1f} KiB" in text
    assert "images    decoded NCHW 3x32x32 (center-crop)" in dt.describe(prepared["decoded"])


def test_decoded_rows_are_the_files_decoded_by_pillow(folder, prepared):
    _, files = folder
    rows = _files_of(prepared["encoded"], files)
    stored = prepared["decoded"].zarr_array("image")[:]
    for row, file in zip(stored, rows, strict=True):
        np.testing.assert_array_equal(row.transpose(1, 2, 0), pillow_decode(file, SIZE))


def _expected(pipe: dt.Pipeline, crop: RandomResizedCrop, flip: RandomHorizontalFlip,
              sources: list[np.ndarray]) -> list[np.ndarray]:
    """Epoch 0 of ``pipe`` computed with Pillow: the plan's order, and per piece the crops
    and flips drawn from the generator the pipeline seeds for it."""
    plan = pipe.plan(0)
    out = []
    for group, blocks in enumerate(plan.groups):
        rows = np.concatenate([np.arange(*plan.block_range(b)) for b in blocks])
        order = plan.group_permutation(group)
        rows = rows if order is None else rows[order]
        starts = plan.piece_starts(group)
        for piece, (a, b) in enumerate(itertools.pairwise(starts)):
            chunk = rows[a:b]
            rng = np.random.default_rng(plan.piece_seed(group, piece))
            boxes, flips = crop.draw(rng, len(chunk)), flip.draw(rng, len(chunk))
            for k, row in enumerate(chunk):
                image = sources[row]
                box = crop.box(boxes, k, *image.shape[:2])
                out.append(pillow_crop(image, box, (crop.size, crop.size), bool(flips[k])))
    return out


@pytest.mark.parametrize("exact", [True, False], ids=["crop-only", "crop-and-resize"])
def test_pipeline_batches_equal_pillow_with_the_same_crops_from_both_storages(
        client, folder, prepared, exact):
    _, files = folder
    sources = [pillow_decode(f, SIZE) for f in _files_of(prepared["encoded"], files)]
    # crop-only: every region is 24 x 24, taken as it is (no resampling: equal to the
    # last bit); crop-and-resize: regions of many sizes resized to 24 x 24.
    crop = (RandomResizedCrop(24, scale=(24 * 24 / 1024,) * 2, ratio=(1.0, 1.0)) if exact
            else RandomResizedCrop(24, scale=(0.2, 1.0)))
    flip = RandomHorizontalFlip()
    batches = {}
    for kind, steps in (("decoded", (crop, flip)), ("encoded", (Resize(32), crop, flip))):
        with dt.Pipeline(prepared[kind], 4, seed=3, shuffle_blocks=2, client=client,
                         transform=ImageTransform(*steps)) as pipe:
            batches[kind] = [x for x, _ in pipe]
            expected = _expected(pipe, crop, flip, sources)
    got = torch.cat(batches["decoded"]).permute(0, 2, 3, 1).numpy()
    assert got.shape == (len(files), 24, 24, 3) and got.dtype == np.uint8
    want = np.stack(expected)
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        # torch's antialiased bilinear is Pillow's filter; integer rounding differs a little
        # (here 0.12 levels on average, 9 at most; a wrong crop or flip differs by tens)
        difference = np.abs(got.astype(int) - want)
        assert difference.mean() < 0.3 and difference.max() <= 16, (difference.mean(),
                                                                    difference.max())
    # Decoded on the workers, the encoded dataset gives the very same batches.
    for a, b in zip(batches["decoded"], batches["encoded"], strict=True):
        assert torch.equal(a, b)


def test_encoded_epochs_resume_exactly_and_see_every_image_once(client, prepared):
    transform = ImageTransform(RandomResizedCrop(16, scale=(0.3, 1)), RandomHorizontalFlip(),
                               Normalize())
    ds = prepared["encoded"]

    def pipeline() -> dt.Pipeline:
        return dt.Pipeline(ds, 4, seed=9, transform=transform, client=client)

    with pipeline() as whole:
        full = list(whole)
    assert sorted(torch.cat([y for _, y in full]).tolist()) == sorted(
        ds.zarr_array("label")[:].tolist())
    x = full[0][0]
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32
    with pipeline() as first:
        it = iter(first)
        for _ in range(2):
            next(it)
        state = first.state_dict()
    with pipeline() as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed)
    assert len(rest) == len(full) - 2
    for (a, ya), (b, yb) in zip(full[2:], rest, strict=True):
        assert torch.equal(a, b) and torch.equal(ya, yb)
    # Normalize runs on the consumer by default: the workers send uint8 pixels, a quarter
    # of the bytes, and the batches are the very ones normalising on the workers gives.
    workers_part, finish = transform.consumer_split()
    piece = workers_part({"image": ds.zarr_array("image")[:4]}, np.random.default_rng(0))
    assert piece["image"].dtype == np.uint8 and finish is not None
    on_workers = ImageTransform(*transform.steps, normalize_on="workers")
    assert on_workers.consumer_split() == (on_workers, None)
    with dt.Pipeline(ds, 4, seed=9, transform=on_workers, client=client) as pipe:
        for (a, ya), (b, yb) in zip(full, pipe, strict=True):
            assert torch.equal(a, b) and torch.equal(ya, yb)


def test_every_image_mode_becomes_its_rgb_pixels_in_both_storages(client, tmp_path):
    # 16-bit greyscale ("I;16") keeps the high byte of each sample; Pillow's own conversion
    # made every value above 255 white.
    expected = write_every_mode(tmp_path / "modes" / "all", height=12, width=16)
    out = {storage: dt.prepare(tmp_path / "modes", tmp_path / f"{storage}.zarr",
                               client=client, progress=False, image_storage=storage,
                               chunk_rows=8)
           for storage in ("decoded", "encoded")}
    rows = _files_of(out["encoded"], sorted(expected))
    assert out["decoded"].attrs["images"]["size"] == [12, 16]
    decoded = out["decoded"].zarr_array("image")[:].transpose(0, 2, 3, 1)
    pipe = dt.Pipeline(out["encoded"], 8, shuffle=False, transform=ImageTransform(),
                       client=client, as_dict=True)
    served = np.concatenate([b["image"].numpy() for b in pipe]).transpose(0, 2, 3, 1)
    for file, stored, batch in zip(rows, decoded, served, strict=True):
        want = expected[file]
        assert want.max() > 200 and want.min() < 60, file.name  # not all white, nor black
        np.testing.assert_array_equal(stored, want, err_msg=file.name)
        np.testing.assert_array_equal(batch, want, err_msg=file.name)


def _one_huge_first(root: Path, others: int = 20) -> Path:
    """``root/a/`` holding a 1200 x 1200 image first, then ``others`` of 64 x 64."""
    (root / "a").mkdir(parents=True)
    huge = root / "a" / "000-huge.png"
    Image.new("RGB", (1200, 1200), (90, 140, 200)).save(huge)
    rng = np.random.default_rng(1)
    for i in range(others):
        Image.fromarray(picture(rng, 64, 64, i)).save(root / "a" / f"{i + 1:03d}.png")
    return huge


def test_the_default_size_is_the_median_of_a_sample_not_the_first_file(client, tmp_path):
    huge = _one_huge_first(tmp_path / "folder")
    with pytest.warns(ImageSizeWarning, match=(
            r"1 of 21 sampled images are far from the size they are stored at, 64x64 \(the "
            rf"median size of 21 sampled files\), and are scaled to it: .*{huge.name} "
            r"\(1200x1200\); give --image-size")):
        ds = dt.prepare(tmp_path / "folder", tmp_path / "out.zarr", client=client,
                        progress=False)
    assert ds.attrs["images"]["size"] == [64, 64]
    assert ds.attrs["images"]["size_from"] == "the median size of 21 sampled files"
    assert ds.attrs["arrays"]["image"]["shape"] == [21, 3, 64, 64]
    assert "3x64x64 (center-crop; the median size of 21 sampled files)" in dt.describe(ds)
    # The command says the size and what the dataset will take before it writes.
    result = run_cli("prepare", str(tmp_path / "folder"), str(tmp_path / "cli.zarr"),
                     "--no-progress", "--scheduler", client.scheduler.address)
    assert result.returncode == 0, result.stderr
    assert (f"preparing {tmp_path / 'cli.zarr'} from {tmp_path / 'folder'}: 21 samples, "
            "about 252.2 KiB before compression; decoded at 64x64, the median size of 21 "
            "sampled files (--image-size sets it): 12.0 KiB an image, 252.0 KiB for 21"
            ) in result.stdout.splitlines()
    assert result.stderr.startswith("dasktrain prepare: warning: 1 of 21 sampled images")


def test_a_default_size_that_would_make_a_huge_dataset_is_refused(tmp_path):
    # 36 files whose headers say 13000 x 13000: 17 GiB decoded. Refused before any work
    for i in range(36):
        (tmp_path / "folder" / "a").mkdir(parents=True, exist_ok=True)
        write_png_header(tmp_path / "folder" / "a" / f"{i:02d}.png", 13000, 13000)
    with pytest.raises(dt.SourceError, match=(
            r"^images decoded at 13000x13000, the median size of 36 sampled files "
            r"\(--image-size sets it\): 483.5 MiB an image, 17.0 GiB for 36, more than 16.0 "
            r"GiB: give --image-size to choose their size \(e.g. --image-size 256, or "
            r"--image-size 13000x13000 to keep this one\), or --image-storage encoded")):
        dt.prepare(tmp_path / "folder", tmp_path / "out.zarr", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


def test_large_images_make_chunks_a_task_can_hold():
    rows = {side: ImageSource.chunk_rows_for(3 * side * side, 4 * 2**20)
            for side in (32, 96, 224, 1200, 8000)}
    # 512-row multiples while 512 rows stay within 256 MiB; then powers of two within it
    assert rows == {32: 1536, 96: 512, 224: 512, 1200: 32, 8000: 1}


@pytest.mark.slow
def test_workers_killed_for_their_memory_are_one_line_naming_the_image_size(tmp_path):
    (tmp_path / "folder" / "a").mkdir(parents=True)
    for i in range(2):
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(tmp_path / "folder" / "a" / f"{i}.png")
    # One worker of 300 MiB, which Dask gives up on after one death; an image of 8000 x 8000
    # takes 183 MiB decoded, and the task holds it at least twice.
    settings = {"distributed.worker.multiprocessing-method": "spawn",
                "distributed.scheduler.allowed-failures": 0}
    with dask.config.set(settings), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                         dashboard_address=None, memory_limit=300 * 2**20) as cluster, \
            Client(cluster):
        result = run_cli("prepare", str(tmp_path / "folder"), str(tmp_path / "out.zarr"),
                         "--image-size", "8000", "--no-progress", "--scheduler",
                         cluster.scheduler_address)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "dasktrain prepare: error: the workers preparing this dataset died while running "
        "its tasks, again and again (Dask gave up: KilledWorker); a worker killed for using "
        "more memory than it may is the usual cause: each decoded image of 8000x8000 takes "
        "183.1 MiB (--image-size): give a smaller --image-size\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


def _bad_folder(root: Path) -> list[Path]:
    files = write_image_folder(root, per_class=3)
    truncated = root / "dog" / "truncated.jpg"
    truncated.write_bytes(files[4].read_bytes()[:300])
    fake = root / "eel" / "fake.png"
    fake.write_text("not an image at all")
    return [truncated, fake]


@pytest.mark.parametrize("storage", ["decoded", "encoded"])
def test_a_file_that_is_not_an_image_is_named_and_nothing_is_written(client, tmp_path,
                                                                      storage):
    _bad_folder(tmp_path / "folder")
    out = tmp_path / "out.zarr"
    with pytest.raises(dt.SourceError, match=r"(truncated\.jpg|fake\.png) is not a readable "
                                             r"image.*--skip-bad"):
        dt.prepare(tmp_path / "folder", out, client=client, progress=False,
                   image_storage=storage, image_size=32 if storage == "decoded" else None,
                   chunk_rows=4)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
    # A file of another kind in a class folder is refused before any work, by name.
    (tmp_path / "folder" / "cat" / "notes.txt").write_text("hello")
    with pytest.raises(dt.SourceError, match=r"notes\.txt: not an image file"):
        dt.prepare(tmp_path / "folder", out, client=client, progress=False)


def test_a_folder_of_no_known_files_names_the_image_layout_too(tmp_path):
    (tmp_path / "photos" / "cats").mkdir(parents=True)
    (tmp_path / "photos" / "cats" / "a.tiff").write_bytes(b"II*\0")
    with pytest.raises(dt.SourceError, match=(
            r"source directory .*photos holds no files of a known kind \(.csv, .*\.txt\), "
            r"nor class sub-folders of images \(.jpg, .jpeg, .png, .bmp, .webp: "
            r".*photos/<class>/<image>\)")):
        dt.prepare(tmp_path / "photos", tmp_path / "out.zarr", progress=False)


def test_skip_bad_leaves_them_out_counted_and_named(client, tmp_path):
    bad = _bad_folder(tmp_path / "folder")
    (tmp_path / "folder" / "cat" / "notes.txt").write_text("hello")
    with pytest.warns(CleaningWarning, match=r"skipped 3 of 12 files"):
        ds = dt.prepare(tmp_path / "folder", tmp_path / "out.zarr", client=client,
                        progress=False, skip_bad=True, image_size=32)
    assert len(ds) == 9 and ds.attrs["images"]["skipped"] == 3
    named = {Path(f).name for f, _ in ds.attrs["images"]["skipped_files"]}
    assert named == {p.name for p in bad} | {"notes.txt"}
    assert sorted(ds.attrs["stats"]["label"]["class_counts"]) == [3, 3, 3]
    assert "3 unreadable files skipped" in dt.describe(ds)


def test_a_manifest_and_folder_urls_give_the_same_images(client, folder, prepared, tmp_path):
    root, files = folder
    # Relative paths from the manifest's folder, text labels (their own class names).
    manifest = root.parent / "manifest.csv"
    pd.DataFrame({"file": [str(f.relative_to(root.parent)) for f in files],
                  "kind": [f"k-{f.parent.name}" for f in files]}).to_csv(manifest, index=False)
    ds = dt.prepare(manifest, tmp_path / "m.zarr", client=client, progress=False,
                    image_storage="encoded", target="kind", chunk_rows=5)
    assert ds.attrs["labels"] == {"label": [f"k-{c}" for c in CLASSES]}
    assert ds.attrs["provenance"]["source_details"]["layout"] == "manifest"
    rows = _files_of(ds, files)
    assert [f"k-{f.parent.name}" for f in rows] == [
        ds.attrs["labels"]["label"][k] for k in ds.zarr_array("label")[:]]
    # The same folder at URLs: file:// (read as a path) and local:// (fsspec's own
    # listing and reads, as for s3:// or gs://): the same images in the same order.
    for scheme in ("file", "local"):
        url = dt.prepare(f"{scheme}://{root}", tmp_path / f"{scheme}.zarr", client=client,
                         progress=False, image_size=32, chunk_rows=5)
        np.testing.assert_array_equal(url.zarr_array("image")[:],
                                      prepared["decoded"].zarr_array("image")[:])


def test_pipeline_and_transform_refuse_what_cannot_work(client, prepared):
    with pytest.raises(ValueError, match=r"\['image'\].*encoded images.*ImageTransform"):
        dt.Pipeline(prepared["encoded"], 4, client=client)
    with pytest.raises(ValueError, match=r"Normalize makes floats.*last"):
        ImageTransform(Normalize(), RandomHorizontalFlip())
    with pytest.raises(ValueError, match=r"normalize_on must be 'consumer' or 'workers'"):
        ImageTransform(Normalize(), normalize_on="gpu")
    normalize = Normalize.of(prepared["decoded"])
    assert len(normalize.mean) == 3 and all(0 < m < 1 for m in normalize.mean)
    with pytest.raises(ValueError, match="kept for decoded images"):
        Normalize.of(prepared["encoded"])
    # Encoded images of different sizes cannot make a batch without a step that sizes them.
    images = np.empty(2, dtype=object)
    for i, shape in enumerate([(8, 8, 3), (9, 8, 3)]):
        out = io.BytesIO()
        Image.fromarray(np.zeros(shape, np.uint8)).save(out, format="PNG")
        images[i] = out.getvalue()
    with pytest.raises(ValueError, match=r"different sizes.*RandomResizedCrop or Resize"):
        ImageTransform()({"image": images}, np.random.default_rng(0))
    # Evaluation and prediction read arrays as stored: encoded images are refused by name.
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(2))
    trainer = dt.Trainer(lambda: net, torch.nn.functional.cross_entropy, dt.optim.sgd(0.1))
    for run in (trainer.evaluate, trainer.predict):
        with pytest.raises(ValueError, match=r"\['image'\] hold encoded images.*decoded"):
            run(prepared["encoded"], client=client)


def test_validation_sees_the_training_transforms_deterministic_part(client, prepared):
    ds = prepared["decoded"]
    augment = ImageTransform(RandomResizedCrop(24), RandomHorizontalFlip(), Normalize.of(ds))
    assert augment.evaluation().steps == (Resize(24), Normalize.of(ds))
    trainer = dt.Trainer(float_convnet, torch.nn.functional.cross_entropy, dt.optim.sgd(0.01),
                         workers=1, batch_size=8, transform=augment, progress=False)
    history = trainer.fit(ds, epochs=1, validation=ds, client=client)
    validation = history.epochs[-1]["validation"]
    assert np.isfinite(validation["loss"]) and 0 <= validation["accuracy"] <= 1
    assert trainer.evaluate(ds, client=client, transform=augment.evaluation()) == validation
    outputs = trainer.predict(ds, client=client).compute()
    assert outputs.shape == (len(ds), len(CLASSES))
    # The same transform decodes encoded images: the same files give the same metrics
    encoded = trainer.evaluate(prepared["encoded"], client=client,
                               transform=ImageTransform(Resize(32), *augment.evaluation().steps))
    assert encoded == pytest.approx(validation, rel=1e-5)


def test_validation_of_stored_pixels_says_why_it_failed_and_keeps_the_history(client,
                                                                            prepared):
    # A transform that is a plain function has no evaluation part: validation reads the
    # stored uint8 pixels, which a float model refuses.
    trainer = dt.Trainer(float_convnet, torch.nn.functional.cross_entropy, dt.optim.sgd(0.01),
                         workers=1, batch_size=8, transform=pixels_as_floats, progress=False)
    with pytest.raises(dt.TrainerError, match=(
            r"evaluation of .* failed: RuntimeError: Input type \(unsigned char\) and bias "
            r"type \(float\) .*; evaluation \(and a fit's validation\) read the images as "
            r"stored, uint8 NCHW, without the training transform: give the Trainer "
            r"transform=ImageTransform")) as caught:
        trainer.fit(prepared["decoded"], epochs=1, validation=prepared["decoded"],
                    client=client)
    assert len(caught.value.history.loss) == 3  # the epoch's updates: 24 rows of 8


def test_crop_regions_follow_scale_and_ratio():
    crop = RandomResizedCrop(8, scale=(0.25, 0.5), ratio=(0.5, 2.0))
    drawn = crop.draw(np.random.default_rng(0), 500)
    for i in range(500):
        top, left, h, w = crop.box(drawn, i, 60, 80)
        assert top >= 0 and top + h <= 60 and left >= 0 and left + w <= 80
        assert 0.2 <= h * w / 4800 <= 0.55 and 0.4 <= w / h <= 2.5
    # The fallback: no region of ratio >= 10 fits a square: the largest centred one.
    wide = RandomResizedCrop(8, scale=(0.9, 1.0), ratio=(10.0, 12.0))
    assert wide.box(wide.draw(np.random.default_rng(1), 1), 0, 20, 20) == (9, 0, 2, 20)


def test_cli_errors_are_one_line_with_exit_2(client, tmp_path):
    _bad_folder(tmp_path / "folder")
    folder, out = str(tmp_path / "folder"), str(tmp_path / "out.zarr")
    cases = [(["--image-size", "32", "--no-progress", "--scheduler", client.scheduler.address],
              ["is not a readable image", "--skip-bad"]),
             (["--image-size", "big"], ["image_size must be N or HxW"]),
             (["--image-storage", "encoded", "--image-size", "32"],
              ["image_size applies to decoded storage"])]
    results = run_cli_batch([["prepare", folder, out, *args] for args, _ in cases])
    for result, (_, fragments) in zip(results, cases, strict=True):
        assert_user_error(result, *fragments)
    assert ("truncated.jpg" in results[0].stderr) or ("fake.png" in results[0].stderr)
    assert not (tmp_path / "out.zarr").exists()
    result = run_cli("prepare", str(tmp_path / "folder"), str(tmp_path / "ok.zarr"),
                     "--image-size", "32", "--skip-bad", "--no-progress",
                     "--scheduler", client.scheduler.address)
    assert result.returncode == 0, result.stderr
    assert "warning: skipped 2 of 11 files" in result.stderr
    assert "images    decoded NCHW 3x32x32" in result.stdout


@pytest.mark.slow
def test_the_benchmark_runs_quick_and_writes_its_rows(tmp_path):
    result, rows = run_benchmark_quick("images", tmp_path, timeout=170)
    assert "| torch DataLoader, num_workers=2 |" in result.stdout
    assert "command: .venv/bin/python benchmarks/images.py --quick" in result.stdout
    assert [r["goal"] for r in rows] == ["≥ 2x DataLoader", "≤ 2 % stall", "≥ 1.0x DataLoader",
                                         "—"]
    assert all(r["ratio"] is None or r["ratio"] > 0 for r in rows)


def _manifest_of(folder: tuple[Path, list[Path]], rows: int, path: Path) -> Path:
    """A manifest of ``rows`` rows naming the folder's files over and over."""
    _, files = folder
    names = [str(f) for f in itertools.islice(itertools.cycle(files), rows)]
    pd.DataFrame({"file": names, "label": [Path(n).parent.name for n in names]}).to_csv(
        path, index=False)
    return path


def test_a_preparing_task_carries_its_own_rows_files_not_the_whole_list(folder, tmp_path):
    # A worker held every file's name (125 MiB for a million) and every task carried the
    # whole list compressed: what a task carries may not grow with the source.
    carried, whole_list = {}, {}
    for rows in (2_000, 40_000):
        source = ImageSource(str(_manifest_of(folder, rows, tmp_path / f"{rows}.csv")),
                             SourceOptions(image_storage="encoded"))
        reader = source.block_reader()
        task = task_reader(reader, [(1_024, 1_536), (1_536, 2_000)])
        carried[rows] = len(pickle.dumps(task))
        whole = pickle.dumps(reader.for_rows(0, rows))
        whole_list[rows] = len(whole)
        # The task's reader reads its rows as the whole list's does, and no others.
        mine, theirs = task(1_536, 2_000), pickle.loads(whole)(1_536, 2_000)
        assert set(mine) == {"image", "label"}
        assert [bytes(b) for b in mine["image"]] == [bytes(b) for b in theirs["image"]]
        np.testing.assert_array_equal(mine["label"], theirs["label"])
        with pytest.raises(ValueError, match="outside"):
            pickle.loads(pickle.dumps(task))(512, 1_024)
    assert carried[40_000] <= carried[2_000] * 1.1, carried
    assert carried[40_000] < whole_list[40_000] / 10, (carried, whole_list)
