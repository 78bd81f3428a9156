"""``dasktrain train CONFIG.toml``: the real command on the session's cluster, the run
directory it writes, resuming it, and every kind of bad config refused by name."""

from __future__ import annotations

import functools
import json
import re
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.cli import _toml_writer, main
from dasktrain.cli._references import load_function
from dasktrain.cli.run_dir import RunDirectory
from dasktrain.cli.train_config import load_train_config
from dasktrain.cli.train_keys import config_keys
from tests.common.builders import REPO, assert_user_error, run_cli

EXAMPLES = REPO / "examples"


@pytest.fixture(scope="module")
def digits(client, tmp_path_factory):
    out = tmp_path_factory.mktemp("train-cli") / "digits.zarr"
    return dt.prepare("digits", out, client=client, split="train=0.8,val=0.2", normalize=True,
                      progress=False)


def _config(dataset: dt.Dataset, **sections: dict) -> dict[str, dict]:
    """A small run's config; ``sections`` replace or add keys (a None value drops one)."""
    config = {
        "data": {"path": dataset.url, "split": "train", "validation": "val"},
        "model": {"factory": "models.py:mlp", "kwargs": {"hidden": 32}},
        "loss": {"name": "cross_entropy"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "trainer": {"epochs": 1, "workers": 2, "batch_size": 64, "metrics": ["accuracy"]},
        "run": {"dir": "runs/small"},
    }
    for name, values in sections.items():
        merged = {**config.get(name, {}), **values}
        config[name] = {k: v for k, v in merged.items() if v is not None}
    return config


def _write(directory: Path, config: dict[str, dict], name: str = "train.toml") -> Path:
    shutil.copy(EXAMPLES / "models.py", directory / "models.py")
    path = directory / name
    path.write_text(_toml_writer.dumps(config))
    return path


def _train(client, config: Path, *args: str):
    return run_cli("train", str(config), "--scheduler", client.scheduler.address,
                   "--no-progress", *args, timeout=170)


def _factory(directory: Path):
    """The model factory the configs name, as a program using the model would build it."""
    return functools.partial(load_function("models.py:mlp", directory), hidden=32)



def _metrics(run: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return ([r for r in rows if r["kind"] == "epoch"],
            [r for r in rows if r["kind"] == "update"])


@pytest.mark.slow
def test_train_writes_the_run_directory(client, digits, tmp_path):
    path = _write(tmp_path, _config(digits, trainer={"epochs": 2}))
    result = _train(client, path)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "small"
    for name in ("config.toml", "metrics.jsonl", "model.pt", "checkpoint/checkpoint.pt"):
        assert (run / name).is_file(), name
    if hasattr(dt.History, "save"):
        assert (run / "history.json").is_file()
    if hasattr(dt.History, "report"):
        assert (run / "report").exists()
    assert str(run / "model.pt") in result.stdout
    assert [line.split()[1] for line in result.stdout.splitlines()
            if line.startswith("epoch ")] == ["1/2", "2/2"]

    epochs, updates = _metrics(run)
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert set(epochs[-1]["validation"]) >= {"loss", "accuracy"}
    assert [u["version"] for u in updates] == list(range(1, len(updates) + 1))
    assert sum(u["samples"] for u in updates) == 2 * len(digits.split("train"))

    resolved = tomllib.loads((run / "config.toml").read_text())
    assert resolved["trainer"]["epochs"] == 2
    assert resolved["trainer"]["seed"] == 0 and resolved["trainer"]["timeout"] == 300.0
    assert resolved["optimizer"]["nesterov"] is False
    assert resolved["model"]["factory"] == f"{tmp_path / 'models.py'}:mlp"
    assert resolved["run"]["dir"] == str(run)
    again = load_train_config(run / "config.toml", progress=False)  # it reads back as is
    assert again.resolved == load_train_config(path, progress=False).resolved

    trainer = dt.Trainer.load(run / "model.pt", model=_factory(tmp_path))
    val = digits.split("val")
    with torch.no_grad():
        predicted = trainer.model(torch.from_numpy(val.x.compute())).argmax(dim=1).numpy()
    accuracy = float(np.mean(predicted == val.y.compute()))
    assert accuracy == pytest.approx(epochs[-1]["validation"]["accuracy"], abs=1e-6)
    assert accuracy > 0.8


@pytest.mark.slow
def test_resume_continues_the_run(client, digits, tmp_path, capsys):
    path = _write(tmp_path, _config(digits))
    assert _train(client, path).returncode == 0
    run = tmp_path / "runs" / "small"
    _, first = _metrics(run)

    # The refusals, in this process (they come before any training).
    def refused(*args: str) -> str:
        assert main(["train", str(path), "--no-progress", "--scheduler",
                     client.scheduler.address, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    assert "already holds a finished run; continue it with --resume" in refused()
    path.write_text(_toml_writer.dumps(_config(digits, trainer={"epochs": 2})))
    result = _train(client, path, "--resume")
    assert result.returncode == 0, result.stderr
    epochs, updates = _metrics(run)
    assert [e["epoch"] for e in epochs] == [0, 1]  # the first epoch was not redone
    assert updates[: len(first)] == first
    assert [u["version"] for u in updates] == list(range(1, 2 * len(first) + 1))
    assert tomllib.loads((run / "config.toml").read_text())["trainer"]["epochs"] == 2
    assert len(dt.Trainer.load(run / "model.pt", model=_factory(tmp_path)).history.epochs) == 2

    # A resume that would change the run is refused by the Trainer, naming the setting,
    # and leaves the run directory as it was.
    path.write_text(_toml_writer.dumps(_config(digits, trainer={"epochs": 3,
                                                                "batch_size": 32})))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    message = refused("--resume")
    assert "cannot resume" in message and "batch_size=64" in message, message
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert "no checkpoint to resume from" in refused("--resume", "--run-dir",
                                                     str(tmp_path / "new"))


def test_a_diverged_run_says_so_in_one_line(client, digits, tmp_path, capsys):
    path = _write(tmp_path, _config(digits, optimizer={"lr": 1e30}))
    assert main(["train", str(path), "--no-progress", "--scheduler",
                 client.scheduler.address]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("dasktrain train: training stopped: training diverged"), err
    assert "no checkpoint was written" in err[0]
    # Nothing to resume: the same command may start the run afresh.
    assert RunDirectory(tmp_path / "runs" / "small").start(resume=False) is None


@pytest.mark.parametrize(("sections", "fragments"), [
    ({"trainer": {"wait_fr": 1}}, ["unknown key [trainer] wait_fr", "wait_for"]),
    ({"model": {"factory": "missing.py:mlp"}}, ["[model] factory", "missing.py"]),
    ({"optimizer": {"lr": -0.1}}, ["[optimizer] lr", "-0.1"]),
])
def test_bad_config_from_the_shell(client, digits, tmp_path, sections, fragments):
    path = _write(tmp_path, _config(digits, **sections))
    assert_user_error(_train(client, path), *fragments)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("sections", "fragments"), [
    ({"trainer": {"mode": "fast"}}, ["[trainer] mode", "unknown mode 'fast'"]),
    ({"trainer": {"staleness_bound": 2}}, ["[trainer] staleness_bound", "of mode 'sync'"]),
    ({"trainer": {"mode": "soft", "wait_for": 5}}, ["[trainer] workers, wait_for"]),
    ({"trainer": {"workers": 0}}, ["[trainer] workers", "positive integer"]),
    ({"trainer": {"epochs": None}}, ["[trainer] epochs: missing"]),
    ({"trainer": {"epochs": 0}}, ["[trainer] epochs"]),
    ({"trainer": {"shuffle": "yes"}}, ["[trainer] shuffle", "true or false"]),
    ({"trainer": {"precision": 16}}, ["[trainer] precision", "a string"]),
    ({"trainer": {"progress": False}}, ["unknown key [trainer] progress", "--no-progress"]),
    ({"trainer": {"metrics": ["acuracy"]}}, ["[trainer] metrics", "unknown metric"]),
    ({"trainer": {"clip_grad_norm": -1.0}}, ["[trainer] clip_grad_norm"]),
    ({"run": {"checkpoint_every": 0}}, ["[run] checkpoint_every"]),
    ({"run": {"every": 3}}, ["unknown key [run] every"]),
    ({"optimizer": {"name": "sgdd"}}, ["[optimizer] name", "unknown optimizer"]),
    ({"optimizer": {"lr": None}}, ["[optimizer] lr", "missing"]),
    ({"optimizer": {"nesterov": True, "momentum": None}}, ["[optimizer] nesterov"]),
    ({"optimizer": {"groups": [{"patterns": ["head.*"], "lr": 0.1}]}},
     ["[optimizer] groups", "matches no parameter"]),
    ({"optimizer": {"groups": [{"pattern": ["0.*"]}]}},
     ["unknown key [optimizer] groups[0].pattern"]),
    ({"model": {"factory": "models.py:mpl"}}, ["[model] factory", "did you mean 'mlp'"]),
    ({"model": {"factory": "nosuch.module:mlp"}}, ["[model] factory", "nosuch"]),
    ({"model": {"kwargs": {"hiden": 3}}}, ["[model] kwargs", "hiden"]),
    ({"loss": {"name": "crossentropy"}}, ["[loss] name", "cross_entropy"]),
    ({"loss": {"kwargs": {"smoothing": 0.1}}}, ["[loss] kwargs", "smoothing"]),
    ({"data": {"split": "trian"}}, ["[data] split", "no split 'trian'", "train, val"]),
    ({"data": {"validation": 3}}, ["[data] validation", "a string"]),
    ({"data": {"path": "nothing.zarr"}}, ["[data] path", "nothing.zarr"]),
    ({"dataa": {"path": "x"}}, ["unknown section [dataa]", "[data]"]),
])
def test_bad_config_names_the_key(digits, tmp_path, capsys, sections, fragments):
    """The same command in this process: every refusal is one line naming the key."""
    path = _write(tmp_path, _config(digits, **sections))
    assert main(["train", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"dasktrain train: error: {path}: "), err
    for fragment in fragments:
        assert fragment in err, err
    assert not (tmp_path / "runs").exists()


def test_unreadable_config_files(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[data]\npath = \n")
    for path, fragment in ((bad, "not valid TOML"), (tmp_path / "none.toml", "no config file")):
        assert main(["train", str(path)]) == 2
        assert fragment in capsys.readouterr().err


def test_a_directory_that_is_not_a_run_is_left_alone(tmp_path):
    precious = tmp_path / "thesis"
    precious.mkdir()
    (precious / "chapter1.tex").write_text("years of work")
    with pytest.raises(ValueError, match="not a dasktrain run directory"):
        RunDirectory(precious).start(resume=False)
    with pytest.raises(ValueError, match="no checkpoint to resume from"):
        RunDirectory(precious).start(resume=True)
    assert [p.name for p in precious.iterdir()] == ["chapter1.tex"]


def test_a_resume_cuts_the_metrics_back_to_its_checkpoint(tmp_path):
    """What a run killed after its checkpoint had logged is redone by the resume: those
    lines go, as does a line cut short."""
    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()
    lines = [{"kind": "update", "version": v} for v in (1, 2, 3)] + \
        [{"kind": "epoch", "epoch": 0}] + [{"kind": "update", "version": v} for v in (4, 5)]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    run.metrics.write_text(text + '{"kind": "upd')
    run.begin("[run]\n", {"holder": {"version": 4}, "complete_epochs": 1})
    assert run.metrics.read_text() == "".join(json.dumps(line) + "\n" for line in lines[:5])
    assert run.config.read_text() == "[run]\n"
    assert sorted(p.name for p in run.path.iterdir()) == ["config.toml", "metrics.jsonl"]


def test_help_and_the_example_document_every_key(digits, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert "see dt.Trainer" not in help_text  # every key has its own description
    example = (EXAMPLES / "digits.toml").read_text()
    for section, keys in config_keys().items():
        assert f"[{section}]" in help_text and f"[{section}]" in example
        for key in keys:
            assert re.search(rf"^    {key}\b", help_text, re.M), (section, key)
            assert re.search(rf"^#? ?{key} = ", example, re.M), (section, key)

    # The example loads as it is, given the dataset where it looks for it.
    (tmp_path / "examples").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "digits.zarr").symlink_to(digits.url)
    for name in ("digits.toml", "models.py"):
        shutil.copy(EXAMPLES / name, tmp_path / "examples" / name)
    config = load_train_config(tmp_path / "examples" / "digits.toml", progress=False)
    assert config.run_dir == (tmp_path / "runs" / "digits").resolve()
    assert config.trainer.model(torch.zeros(3, 64)).shape == (3, 10)
    # A dataset of several named arrays trains from a config too: model(**inputs).
    text = (tmp_path / "examples" / "digits.toml").read_text()
    (tmp_path / "examples" / "named.toml").write_text(
        text.replace("# as_dict = false", "as_dict = true"))
    named = load_train_config(tmp_path / "examples" / "named.toml", progress=False)
    assert named.trainer.pipeline_options["as_dict"] is True
    assert named.resolved["trainer"]["as_dict"] is True


def test_resolved_toml_round_trips():
    tables = {"a": {"s": 'quote " back \\ tab \t del \x7f é', "i": -3, "f": 1e-8,
                    "inf": float("inf"), "b": True, "l": [0.9, 0.999], "none": None,
                    "t": {"x": 1, "y-z": "w", "gone": None}, "g": [{"p": ["a.*"]}]},
              "with space": {"k": 1}}
    parsed = tomllib.loads(_toml_writer.dumps(tables, header="two\nlines"))
    expected = {**tables["a"], "t": {"x": 1, "y-z": "w"}}
    del expected["none"]
    assert parsed == {"a": expected, "with space": {"k": 1}}
