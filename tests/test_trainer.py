"""The trainer on a real cluster: sync equals one process, async converges, checkpoints
resume exactly, bad pushes are refused."""

from __future__ import annotations

import asyncio
import functools
import math

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.trainer.flat import FlatLayout, FlatModel
from dasktrain.trainer.holder import HolderConfig, ParameterHolder
from tests.common.training import (
    flat_parameters,
    mlp,
    mlp_from,
    mse,
    nan_on,
    one_process,
    random_init,
    zeros_holder,
)


@pytest.fixture(scope="module")
def regression(client, tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer") / "reg.zarr"
    return dt.prepare("regression", out, client=client, samples=600, width=4, chunk_rows=100,
                      seed=3, progress=False)


def _trainer(mode="sync", workers=2, batch_size=16, optimizer=None, **kw):
    return dt.Trainer(mlp, mse, optimizer or dt.optim.sgd(0.05, momentum=0.9,
                                                          weight_decay=1e-3),
                      mode=mode, workers=workers, batch_size=batch_size, progress=False, **kw)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sync_equals_one_process_on_the_union_batch(client, regression, workers):
    config = dt.optim.sgd(0.05, momentum=0.9, weight_decay=1e-3)
    trainer = _trainer("sync", workers, 16, config)
    history = trainer.fit(regression, epochs=2, client=client)
    expected = one_process(regression, mlp, config, workers * 16, 2, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)
    steps = 2 * math.ceil(math.ceil(600 / 16) / workers)
    assert history.updates == steps
    assert history.staleness == [0] * len(history.staleness)
    assert sum(history.samples) == 2 * 600
    # Workers in the holder's process call it in place; the others use the direct channel.
    via = history.epochs[0]["exchange_via"]
    assert sum(via.values()) == workers and "actor" not in via
    assert workers == 1 or via.get("direct", 0) >= 1


def test_sync_through_the_actor_alone_is_the_same(client, regression):
    config = dt.optim.sgd(0.05, momentum=0.9, weight_decay=1e-3)
    trainer = _trainer("sync", 2, 16, config, direct_channel=False)
    history = trainer.fit(regression, epochs=1, client=client)
    expected = one_process(regression, mlp, config, 32, 1, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)
    assert history.epochs[0]["exchange_via"] == {"local": 1, "actor": 1}


@pytest.mark.parametrize("config", [dt.optim.adam(0.01), dt.optim.adamw(0.01),
                                    dt.optim.sgd(0.05, momentum=0.9, nesterov=True,
                                                 warmup_steps=5, schedule="cosine")],
                         ids=["adam", "adamw", "sgd-nesterov-warmup-cosine"])
def test_sync_optimizers_on_the_holder_equal_torch_optim(client, regression, config):
    trainer = _trainer("sync", 2, 16, config)
    trainer.fit(regression, epochs=1, client=client)
    if config.schedule == "cosine":  # the fit's length sets the decay
        config = dt.optim.sgd(0.05, momentum=0.9, nesterov=True, warmup_steps=5,
                              schedule="cosine", total_steps=trainer.history.updates)
    expected = one_process(regression, mlp, config, 32, 1, client)
    torch.testing.assert_close(flat_parameters(trainer.model), expected, rtol=1e-5,
                               atol=1e-6)


def test_async_converges_and_records_staleness(client, regression):
    trainer = _trainer("async", 2, 16, dt.optim.sgd(0.05))
    before = trainer.evaluate(regression, client=client)["loss"]
    history = trainer.fit(regression, epochs=3, client=client, validation=regression)
    after = history.epochs[-1]["validation"]["loss"]
    assert after < 0.5 * before
    assert history.updates == 3 * math.ceil(600 / 16)
    assert len(history.staleness) == history.updates
    assert min(history.staleness) >= 0 and max(history.staleness) >= 1
    assert set(history.staleness_worker) == {0, 1}
    assert history.summary()["mean_staleness"] > 0


def test_the_gap_between_epochs_is_recorded_per_worker(client, regression):
    trainer = _trainer("sync", 2, 16, dt.optim.sgd(0.05))
    history = trainer.fit(regression, epochs=3, client=client)
    first, *later = history.epochs
    assert first["gap_s"] is None and [w["gap_s"] for w in first["per_worker"]] == [None] * 2
    for record in later:
        gaps = [w["gap_s"] for w in record["per_worker"]]
        # From a worker's last step of the epoch before to its first of this one:
        # leaving, the holder beginning the next epoch, the first batch.
        assert all(0 < g < history.wall_time for g in gaps), gaps
        assert record["gap_s"] == max(gaps)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_nonfinite_gradients_are_refused_and_counted(client, regression, mode):
    special = float(regression.y[123, 0].compute())
    loss = functools.partial(nan_on, special=special)
    trainer = dt.Trainer(mlp, loss, dt.optim.sgd(0.05), mode=mode, workers=2, batch_size=16,
                         progress=False, on_nonfinite="skip")
    history = trainer.fit(regression, epochs=2, client=client)
    assert history.refused_gradients == 2  # one batch per epoch holds sample 123
    assert torch.isfinite(flat_parameters(trainer.model)).all()
    assert sum("non-finite" in e for e in history.events) == 2


def test_checkpoint_resume_ends_with_the_same_parameters(client, regression, tmp_path):
    straight = _trainer("sync")
    straight.fit(regression, epochs=3, client=client)
    first = _trainer("sync")
    first.fit(regression, epochs=1, client=client, checkpoint=tmp_path / "run")
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    resumed = _trainer("sync")
    history = resumed.fit(regression, epochs=3, client=client, resume=tmp_path / "run",
                          checkpoint=tmp_path / "run")
    # Equal to float tolerance: BLAS kernels may round the last bit differently with the
    # alignment of received batches, so even two uninterrupted runs differ by ~1e-7.
    torch.testing.assert_close(flat_parameters(resumed.model),
                               flat_parameters(straight.model), rtol=1e-5, atol=1e-6)
    assert [e["epoch"] for e in history.epochs] == [0, 1, 2]
    assert history.updates == straight.history.updates


def test_resume_refuses_another_setup(client, regression, tmp_path):
    _trainer("sync").fit(regression, epochs=1, client=client, checkpoint=tmp_path / "run")
    with pytest.raises(ValueError, match="made with workers=2, this trainer has workers=3"):
        _trainer("sync", workers=3).fit(regression, epochs=2, client=client,
                                         resume=tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        _trainer().fit(regression, epochs=2, client=client, resume=tmp_path / "nothing")


def test_save_and_load_round_trip(client, regression, tmp_path):
    trainer = _trainer("async", optimizer=dt.optim.adam(0.01))
    trainer.fit(regression, epochs=1, client=client)
    path = trainer.save(tmp_path / "model.pt")
    loaded = dt.Trainer.load(path, model=mlp, loss=mse)
    assert torch.equal(flat_parameters(loaded.model), flat_parameters(trainer.model))
    assert loaded.mode == "async" and loaded.optimizer == trainer.optimizer
    assert loaded.history.updates == trainer.history.updates
    with pytest.raises(RuntimeError):
        dt.Trainer.load(path, model=functools.partial(mlp, hidden=9), loss=mse)


def test_holder_refuses_mismatched_models(client):
    config = HolderConfig(model=mlp, optimizer=dt.optim.sgd(0.1), workers=2)
    future = client.submit(ParameterHolder, config, actor=True, pure=False)
    holder = future.result()
    try:
        other = FlatLayout.of(mlp(hidden=9))
        with pytest.raises(ValueError, match="model does not match the holder's"):
            holder.join(0, None, other).result(timeout=30)
        good = FlatLayout.of(mlp())
        info = holder.join(0, None, good).result(timeout=30)
        assert info["version"] == 0 and info["params"].shape == (good.size,)
        wrong = np.zeros(good.size + 3, dtype=np.float32)
        with pytest.raises(ValueError, match="model differs from the holder's"):
            holder.push(0, 1, 0, wrong, 4, 0.0, (0, 1)).result(timeout=30)
        with pytest.raises(ValueError, match="unknown worker 5"):
            holder.push(5, 1, 0, None, 0, 0.0, (0, 1)).result(timeout=30)
    finally:
        holder.close().result(timeout=30)
        future.release()


def test_workers_start_from_the_holders_parameters(client, regression, tmp_path):
    make = functools.partial(random_init, str(tmp_path))
    trainer = dt.Trainer(make, mse, dt.optim.sgd(0.05), workers=2, batch_size=16,
                         progress=False)
    trainer.fit(regression, epochs=1, client=client)
    inits = [torch.load(p) for p in sorted(tmp_path.glob("init-*.pt"))]
    assert len({tuple(i.tolist()) for i in inits}) == len(inits) >= 4  # all different
    # Sync from the holder's initialisation equals one process started there; had a
    # worker computed its first gradient at its own initialisation, nothing would match.
    matches = []
    for init in inits:
        start = functools.partial(mlp_from, init)
        expected = one_process(regression, start, dt.optim.sgd(0.05), 32, 1, client)
        matches.append(torch.allclose(flat_parameters(trainer.model), expected, rtol=1e-5,
                                      atol=1e-6))
    assert sum(matches) == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "bogus"}, "unknown mode 'bogus'"),
    ({"mode": "sync", "average_every": 3}, "takes no option"),
    ({"workers": 0}, "workers must be a positive integer"),
    ({"batch_size": -1}, "batch_size must be a positive integer"),
    ({"checkpoint_every": 0}, "checkpoint_every must be >= 1"),
])
def test_bad_trainer_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dt.Trainer(mlp, mse, dt.optim.sgd(0.1), progress=False, **kwargs)


def test_bad_optimizer_settings_are_refused():
    with pytest.raises(TypeError, match=r"dt\.optim"):
        dt.Trainer(mlp, mse, torch.optim.SGD, progress=False)
    for bad, message in [(dict(lr=0), "lr must be"), (dict(lr=1, momentum=1), "momentum"),
                         (dict(lr=1, nesterov=True), "nesterov"),
                         (dict(lr=1, schedule="zigzag"), "schedule must be")]:
        with pytest.raises(ValueError, match=message):
            dt.optim.sgd(**bad)
    with pytest.raises(ValueError, match="unknown optimizer"):
        dt.optim.get_optimizer("lion", lr=1)


def test_batch_larger_than_dataset_is_refused(client, regression):
    with pytest.raises(ValueError, match="larger than the 600 samples"):
        _trainer(batch_size=601).fit(regression, epochs=1, client=client)


def test_learning_rate_schedules():
    config = dt.optim.sgd(1.0, warmup_steps=4, schedule="cosine", total_steps=14)
    rates = [config.lr_at(t) for t in range(16)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]
    assert rates[4] == 1.0 and rates[9] == pytest.approx(0.5) and rates[14] == 0.0
    step = dt.optim.sgd(1.0, schedule="step", step_size=3, gamma=0.5)
    assert [step.lr_at(t) for t in range(7)] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25]
    linear = dt.optim.adam(1.0, schedule="linear")
    assert linear.lr_at(5, total_steps=10) == 0.5


def test_flat_model_gradients_and_buffers_live_in_one_buffer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                               torch.nn.Linear(4, 1))
    twin.load_state_dict(model.state_dict())
    flat = FlatModel(model)
    x = torch.randn(8, 3)
    model(x).sum().backward()
    twin(x).sum().backward()
    payload = flat.payload()
    grads = torch.cat([p.grad.reshape(-1) for p in twin.parameters()])
    buffers = torch.cat([twin[1].running_mean, twin[1].running_var])
    assert flat.layout.size == grads.numel() + buffers.numel()
    torch.testing.assert_close(torch.from_numpy(payload.copy()), torch.cat([grads, buffers]))
    flat.load(np.arange(flat.layout.size, dtype=np.float32))
    assert model[0].weight.reshape(-1)[0] == 0 and model[1].running_var[-1] == \
        flat.layout.size - 1


class _SharedAndUnused(torch.nn.Module):
    """A layer used twice in one forward pass, and one not used at all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.twice = torch.nn.Linear(3, 3)
        self.unused = torch.nn.Linear(3, 1)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.twice(torch.tanh(self.twice(x)))))


def test_flat_gradients_are_each_backward_passs_own_without_zeroing_the_buffer():
    model, twin = _SharedAndUnused(), _SharedAndUnused()
    flat = FlatModel(model)
    flat.grads.fill_(7.0)  # what a last step left: never read again
    for _ in range(3):
        x = torch.randn(5, 3)
        flat.zero_grad()
        twin.zero_grad(set_to_none=False)
        model(x).pow(2).sum().backward()
        flat.gradients_done()
        twin(x).pow(2).sum().backward()
        expected = _grads(twin)
        torch.testing.assert_close(flat.grads, expected, rtol=0, atol=0)
        # every .grad is a view of the flat buffer again, the unused layer's zeros
        for p in model.parameters():
            assert p.grad.untyped_storage().data_ptr() == flat.grads.untyped_storage().data_ptr()
        assert not model.unused.weight.grad.any()
        assert flat.payload()[: flat.layout.num_params].tolist() == expected.tolist()
    # Without zero_grad between two passes, the second adds to the first (accumulation).
    x = torch.randn(5, 3)
    for _ in range(2):
        model(x).sum().backward()
        twin(x).sum().backward()
    flat.gradients_done()
    torch.testing.assert_close(flat.grads, _grads(twin))


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.reshape(-1)
                      for p in model.parameters()])


class _Float64Buffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.register_buffer("scale", torch.ones(2, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.mul_(2.0)
        return self.linear(x) * self.scale.float()


def test_flat_model_receives_straight_into_its_own_parameters_and_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    flat = FlatModel(model)
    target = flat.receive_buffer()
    target[:] = np.arange(flat.layout.size, dtype=np.float32)  # as a reply lands
    flat.load(target)
    state = torch.cat([flat_parameters(model), model[1].running_mean, model[1].running_var])
    torch.testing.assert_close(state, torch.arange(flat.layout.size, dtype=torch.float32))
    model(torch.randn(8, 3))  # batch norm updates its statistics in the flat state
    assert np.array_equal(flat.payload()[-8:], flat.state()[-8:])
    assert not np.array_equal(flat.state()[-8:], np.arange(flat.layout.size)[-8:])
    # A buffer of another precision keeps its dtype and is copied in and out.
    odd = FlatModel(_Float64Buffer())
    odd.model(torch.ones(1, 2))
    assert odd.model.scale.dtype == torch.float64
    assert odd.payload()[-2:].tolist() == [2.0, 2.0]
    odd.load(np.full(odd.layout.size, 3.0, dtype=np.float32))
    assert odd.model.scale.tolist() == [3.0, 3.0]


@pytest.mark.parametrize("features", [1000, (1 << 20) + 8])  # inline and threaded updates
def test_state_dict_is_never_taken_half_way_through_an_update(features):
    """Plain SGD with lr 1 on gradients of ones: every parameter is exactly -version, in
    every state_dict and every progress report taken while updates run."""
    async def scenario():
        holder = ParameterHolder(zeros_holder(features))
        ones = np.ones(features, dtype=np.float32)
        await holder.join(0, None, holder.layout)
        pushed = 0

        async def pusher():
            nonlocal pushed
            for _ in range(200):
                pushed += 1
                await holder.push(0, 1, holder.version, ones, 1, 0.0, (0, pushed))
                await asyncio.sleep(0)  # let the reader in between pushes

        task = asyncio.ensure_future(pusher())
        seen = []
        while not task.done():
            state = await holder.state_dict()
            assert torch.equal(state["params"],
                               torch.full_like(state["params"], -state["version"]))
            assert state["positions"].get(0, [0, 0])[1] == state["version"]
            report = await holder.progress()
            assert len(set(map(len, report["records"].values()))) == 1
            seen.append(state["version"])
            await asyncio.sleep(0)  # and the pusher in between reads
        await task
        await holder.close()
        return seen

    seen = asyncio.run(scenario())
    assert len(seen) > 1


def test_state_at_is_taken_at_exactly_that_version():
    async def scenario():
        holder = ParameterHolder(zeros_holder(10))
        ones = np.ones(10, dtype=np.float32)
        await holder.join(0, None, holder.layout)
        at_five = asyncio.ensure_future(holder.state_at(5))
        await asyncio.sleep(0)  # let it register before the updates run
        for step in range(8):
            await holder.push(0, 1, holder.version, ones, 1, 0.0, (0, step + 1))
        now = await holder.state_at(3)  # already past: the current state
        pending = asyncio.ensure_future(holder.state_at(100))
        await asyncio.sleep(0)
        await holder.close()
        with pytest.raises(dt.TrainerError, match="closed"):
            await pending
        return await at_five, now

    at_five, now = asyncio.run(scenario())
    assert at_five["version"] == 5
    assert torch.equal(at_five["params"], torch.full_like(at_five["params"], -5.0))
    assert now["version"] == 8


def test_an_average_near_the_float32_limit_is_taken_as_a_weighted_sum():
    """The running mean takes differences (3e38 - -3e38 overflows); finite payloads whose
    weighted sum is finite must still be applied, not refused or turned into inf."""
    async def scenario(values):
        holder = ParameterHolder(zeros_holder(4, workers=2, mode="sync"))
        for w in range(2):
            await holder.join(w, None, holder.layout)
        pushes = [holder.push(w, 1, 0, np.full(4, v, dtype=np.float32), 1, 0.0, (0, 1))
                  for w, v in enumerate(values)]
        (params, version), _ = await asyncio.gather(*pushes)
        refused = holder._host.refused
        await holder.close()
        return params.copy(), version, refused

    params, version, refused = asyncio.run(scenario([3e38, -3e38]))
    assert version == 1 and refused == 0 and np.array_equal(params, np.zeros(4))
    params, version, refused = asyncio.run(scenario([3e38, 1e38]))
    assert refused == 0 and np.allclose(params, -2e38, rtol=1e-6)


def test_evaluate_and_predict_send_the_model_alone_and_leave_it_as_it_was(client, regression):
    import pickle

    from dasktrain.trainer.driver.inference import compact_copy

    trainer = _trainer()
    trainer.fit(regression, epochs=1, client=client)
    model = trainer.model
    values = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    # After a fit the parameters are views of the trainer's flat storage, which pickles
    # whole with any view of it; what evaluation sends holds the model's values only.
    sent = len(pickle.dumps(compact_copy(model)))
    assert sent < values + 4096, (sent, values)
    assert len(pickle.dumps(model)) - sent >= values  # the view carries at least a copy more
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    trainer.evaluate(regression, client=client)
    trainer.predict(regression, client=client).compute()
    assert model.training  # predict's eval() was on its copy
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _as_read(arrays, rng):
    return arrays  # a transform: the pipeline's reads become Dask tasks


def _spans(dask_scheduler) -> dict[str, tuple[tuple[str, ...], list[str]]]:
    return {span.id: (span.name, sorted(g.name for g in span.groups))
            for span in dask_scheduler.extensions["spans"].spans.values()}


def test_a_fits_tasks_are_in_one_dask_span_of_its_own(client, regression):
    # Each task submitted outside a span made the scheduler walk the default span's task
    # groups, which grew by an epoch's validation every epoch: a long fit's epochs slowed
    # (W14). The pipeline's tasks are submitted from a thread of their own: they too.
    before = client.run_on_scheduler(_spans)
    read_by_tasks = dt.Pipeline(regression, batch_size=16, transform=_as_read)
    _trainer("async", 2, 16, dt.optim.sgd(0.05)).fit(read_by_tasks, epochs=2, client=client,
                                                      validation=regression)
    opened = {k: v for k, v in client.run_on_scheduler(_spans).items() if k not in before}
    assert [name for name, _ in opened.values()] == [("dasktrain-fit",)], opened
    (groups,) = [groups for _, groups in opened.values()]
    # (The holder's group may be an earlier fit's, still known to the scheduler: Dask
    # keeps a task group in the span it first had.)
    assert {"dasktrain-trainer", "dasktrain-batches", "evaluate_block"} <= set(groups), groups
    # A trainer task runs the whole fit: Dask would keep every exchange's metering (its
    # serializing, compressing...) in a list until the task ends, a list that grew by
    # ~16 KB an epoch. Its time is metered as the task's own, nothing finer.
    client.run(_heartbeat)  # the workers' metrics of the finished tasks, sent now
    (span_id,) = opened
    metered = client.run_on_scheduler(_trainer_activities, span_id)
    assert "thread-cpu" in metered, metered  # the task's metrics have come in
    assert not metered & {"serialize", "compress", "decompress", "deserialize"}, metered


async def _heartbeat(dask_worker) -> None:
    await dask_worker.heartbeat()


def _trainer_activities(span_id: str, dask_scheduler=None) -> set[str]:
    """What Dask metered inside the fit's trainer tasks, by activity."""
    span = dask_scheduler.extensions["spans"].spans[span_id]
    return {key[2] for key in span.cumulative_worker_metrics
            if key[0] == "execute" and key[1] == "dasktrain-trainer"}
