"""The CUDA path on a real GPU (marker ``gpu``): skipped where torch sees no GPU, so CI, which
has none, never runs these; ``pytest -m gpu`` on a machine with one does.

Tolerances: a replica on CUDA and one on the CPU run the same float32 arithmetic in
different kernels (other summation orders), so their parameters after a fit agree to
``rtol=1e-4, atol=1e-5``, TF32 off (PyTorch's default for matrix products). Batches, which
only move and normalise bytes, agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from distributed import Client

import dasktrain as dt
from dasktrain.pipeline.images import (
    ImageTransform,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
)
from tests.common.images import write_image_folder
from tests.common.training import flat_parameters, mlp, mse, one_process
from tests.test_cluster_scripts import fit_beside_cpu_workers

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CLOSE = {"rtol": 1e-4, "atol": 1e-5}


def on_cuda(output: torch.Tensor, target: torch.Tensor) -> float:
    """A metric whose mean says where the batches were computed (1: all on a GPU)."""
    return float(output.is_cuda)


def loud_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE times 1,000: at fp16's first loss scale (2^16) its gradients overflow float16,
    so the first steps are skipped until the scale has come down."""
    return 1000.0 * mse(output, target)


def all_rows(dataset: dt.Dataset, client: Client) -> tuple[torch.Tensor, torch.Tensor]:
    pipe = dt.Pipeline(dataset, len(dataset), shuffle=False, client=client)
    return next(iter(pipe))


def fit(client, dataset, device: str, workers: int = 2, epochs: int = 2, mode: str = "sync",
        **options):
    trainer = dt.Trainer(mlp, options.pop("loss", mse),
                         options.pop("optimizer", dt.optim.sgd(0.05, momentum=0.9)), mode,
                         workers=workers, batch_size=16, device=device, progress=False,
                         metrics={"on_cuda": on_cuda}, **options)
    history = trainer.fit(dataset, epochs=epochs, client=client)
    return trainer, history


def test_sync_on_cuda_equals_the_cpu_fit_and_one_process(client, regression):
    # Two replicas on the cluster's two workers, both on the one GPU.
    on_gpu, history = fit(client, regression, "cuda")
    assert all(e["train"]["on_cuda"] == 1.0 for e in history.epochs)
    assert len({w["address"] for w in history.epochs[-1]["per_worker"]}) == 2
    on_cpu, cpu_history = fit(client, regression, "cpu")
    assert all(e["train"]["on_cuda"] == 0.0 for e in cpu_history.epochs)
    torch.testing.assert_close(flat_parameters(on_gpu.model), flat_parameters(on_cpu.model),
                               **CLOSE)
    expected = one_process(regression, mlp, dt.optim.sgd(0.05, momentum=0.9), 32, 2, client)
    torch.testing.assert_close(flat_parameters(on_gpu.model), expected, **CLOSE)
    assert (expected - flat_parameters(mlp())).abs().max() > 1e-2  # it did move


@pytest.mark.parametrize("optimizer", [dt.optim.sgd(0.05, momentum=0.9), dt.optim.adam(0.01)],
                         ids=["sgd-momentum", "adam"])
def test_average_with_one_replica_steps_on_cuda_as_sync_does(client, regression, optimizer):
    # The optimizer's state travels to the holder and back every round: it must come back
    # onto the GPU (Adam's step stays on the processor, as torch keeps it).
    local, history = fit(client, regression, "cuda", workers=1, mode="average",
                         optimizer=optimizer)
    assert all(e["train"]["on_cuda"] == 1.0 for e in history.epochs)
    sync, _ = fit(client, regression, "cuda", workers=1, optimizer=optimizer)
    torch.testing.assert_close(flat_parameters(local.model), flat_parameters(sync.model),
                               **CLOSE)
    assert history.updates < len(regression) // 16  # fewer exchanges than batches


def test_bf16_on_cuda_trains_to_the_float32_loss(client, regression):
    finals = {}
    for precision in ("32", "bf16"):
        _, history = fit(client, regression, "cuda", epochs=4, precision=precision,
                         optimizer=dt.optim.adam(0.02))
        assert history.epochs[-1]["train"]["on_cuda"] == 1.0
        finals[precision] = history.loss[-1]
    first = dt.Trainer(mlp, mse, dt.optim.adam(0.02)).evaluate(regression, client=client)
    assert finals["32"] < 0.5 * first["loss"]
    assert finals["bf16"] == pytest.approx(finals["32"], rel=0.10)


def test_fp16_on_cuda_skips_the_steps_that_overflow_and_trains(client, regression):
    trainer, history = fit(client, regression, "cuda", epochs=4, precision="fp16",
                           loss=loud_mse, optimizer=dt.optim.adam(0.02))
    overflows = [e["overflow_steps"] for e in history.epochs]
    # Each worker's scale starts at 2^16 and halves per overflow until the gradients fit.
    assert overflows[0] >= 2, overflows
    assert overflows[-1] == 0, overflows
    assert history.loss[-1] < 0.5 * history.loss[0]
    assert torch.isfinite(flat_parameters(trainer.model)).all()


def test_evaluate_and_predict_run_on_cuda_and_match_the_cpu(client, regression):
    trainer, _ = fit(client, regression, "cuda", epochs=1)
    metrics = trainer.evaluate(regression, client=client)
    assert metrics["on_cuda"] == 1.0
    x, y = all_rows(regression, client)
    model = trainer.model.eval()
    with torch.no_grad():
        expected = model(x)
    assert metrics["loss"] == pytest.approx(float(mse(expected, y)), rel=1e-5)

    def with_place(model, batch):
        inputs = batch[0]
        out = model(inputs)
        return torch.cat([out, torch.full_like(out, float(inputs.is_cuda))], dim=1)

    outputs = torch.from_numpy(trainer.predict(regression, forward=with_place,
                                               client=client).compute(scheduler=client))
    assert (outputs[:, 1] == 1.0).all()  # every block computed on the GPU
    torch.testing.assert_close(outputs[:, :1], expected, **CLOSE)


def test_pipeline_batches_on_cuda_equal_the_cpu_ones_bit_for_bit(client, regression, tmp_path):
    for device in ("cuda", "cpu"):
        batches = list(dt.Pipeline(regression, 32, seed=3, device=device, client=client))
        if device == "cuda":
            on_gpu = batches
            assert all(x.is_cuda and y.is_cuda for x, y in batches)
    for (gx, gy), (cx, cy) in zip(on_gpu, batches, strict=True):
        assert torch.equal(gx.cpu(), cx) and torch.equal(gy.cpu(), cy)
    # Images: the floats made on the GPU after the copy (the default, normalize_on=
    # "consumer") equal the ones the workers make on the CPU.
    write_image_folder(tmp_path / "folder", per_class=12, height=40, width=48)
    images = dt.prepare(tmp_path / "folder", tmp_path / "images.zarr", client=client,
                        image_size="40x48", progress=False)
    steps = (RandomResizedCrop(32), RandomHorizontalFlip(), Normalize())
    gpu = list(dt.Pipeline(images, 8, seed=1, device="cuda", client=client,
                           transform=ImageTransform(*steps)))
    cpu = list(dt.Pipeline(images, 8, seed=1, client=client,
                           transform=ImageTransform(*steps, normalize_on="workers")))
    assert gpu[0][0].is_cuda and gpu[0][0].dtype == torch.float32
    for (gx, gy), (cx, cy) in zip(gpu, cpu, strict=True):
        assert torch.equal(gx.cpu(), cx) and torch.equal(gy.cpu(), cy)


@pytest.mark.slow
def test_a_gpu_worker_beside_cpu_workers_gets_the_replica_on_cuda(regression, tmp_path):
    history, gpu = fit_beside_cpu_workers(regression, tmp_path, metrics={"on_cuda": on_cuda})
    assert [w["address"] for w in history.epochs[-1]["per_worker"]] == [gpu]
    assert all(e["train"]["on_cuda"] == 1.0 for e in history.epochs)
