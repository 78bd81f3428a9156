"""The documented example of a new mode (docs/modes.md) is real code: it runs against a holder
as written."""

from __future__ import annotations

import asyncio
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from dasktrain.trainer import modes
from dasktrain.trainer.holder.actor import ParameterHolder
from tests.common.training import zeros_holder

README = Path(__file__).resolve().parents[1] / "docs" / "modes.md"


def _example_module() -> types.ModuleType:
    text = README.read_text()
    found = re.search(r"```python\n(# trainer/modes/bounded\.py\n.*?)```", text, re.S)
    assert found, "docs/modes.md lost its example mode"
    module = types.ModuleType("bounded_example")
    sys.modules[module.__name__] = module  # dataclasses and typing look modules up
    exec(compile(found.group(1), "docs/modes.md (example mode)", "exec"), module.__dict__)
    return module


@pytest.fixture
def bounded(monkeypatch):
    """The example mode, with its one registry entry."""
    mode = _example_module().BoundedMode
    monkeypatch.setitem(modes.MODES, "bounded", mode)
    yield mode
    sys.modules.pop("bounded_example", None)


def test_the_documented_example_mode_applies_fresh_gradients_and_drops_stale_ones(bounded):
    async def scenario():
        config = zeros_holder(3, workers=2, mode="bounded")
        config.mode_options = {"max_staleness": 1}
        holder = ParameterHolder(config)
        for w in range(2):
            await holder.join(w, None, holder.layout)
        g = np.ones(3, dtype=np.float32)
        for step in range(3):  # worker 0 moves the holder to version 3
            await holder.push(0, 1, holder.version, g, 1, 0.5, (0, step + 1))
        await holder.push(1, 1, 2, g, 1, 0.5, (0, 1))  # staleness 1: applied
        await holder.push(1, 1, 0, g, 1, 0.5, (0, 2))  # staleness 4: dropped
        await holder.push(1, 1, 4, g, 1, 0.5, (0, 3))  # the drop is recorded with this update
        params, version = await holder.pull()
        records = (await holder.progress())["records"]
        await holder.close()
        return params, version, records

    params, version, records = asyncio.run(scenario())
    assert version == 5
    np.testing.assert_array_equal(params, np.full(3, -5.0, dtype=np.float32))
    assert records["dropped"] == [False, False, False, False, True, False]
    assert records["staleness"] == [0, 0, 0, 1, 4, 0]
    assert records["gradients"] == [1, 1, 1, 1, 2]


def test_the_documented_example_mode_refuses_bad_options(bounded):
    with pytest.raises(ValueError, match="max_staleness"):
        modes.mode_class("bounded").check(2, {"max_staleness": -1})
    with pytest.raises(ValueError, match="takes no option"):
        modes.mode_class("bounded").check(2, {"staleness_bound": 1})


def test_the_documented_optimizer_trains_as_written(client, regression):
    """docs/modes.md's SignSGD, run as written (with a small model and loss for its ``net``
    and ``loss``), trains on the cluster with the holder in another process."""
    import torch

    import dasktrain as dt
    from tests.common.training import flat_parameters, mlp, mse

    text = README.read_text()
    found = re.search(r"```python\n(class SignSGD.*?)```", text, re.S)
    assert found, "docs/modes.md lost its example optimizer"
    namespace = {"torch": torch, "dt": dt, "net": mlp, "loss": mse}
    before = dt.optim.OPTIMIZERS.get("signsgd")  # another module's entry of that name
    try:
        exec(compile(found.group(1), "docs/modes.md (example optimizer)", "exec"), namespace)
        trainer = namespace["trainer"]
        trainer.fit(regression, epochs=1, client=client)
    finally:
        dt.optim.OPTIMIZERS.pop("signsgd", None)
        if before is not None:
            dt.optim.OPTIMIZERS["signsgd"] = before
    assert (flat_parameters(trainer.model) - flat_parameters(mlp())).abs().max() > 1e-3
