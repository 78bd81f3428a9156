"""The ``dasktrain`` command: thin wrappers that parse arguments and call one library function.

User mistakes (bad paths, options, data) print one line on stderr and exit with status 2;
Ctrl-C (SIGINT) exits with 130 and SIGTERM with 143 after the interrupted command has cleaned
up after itself. A warning is one line on stderr. An internal error (a bug) shows its
traceback and exits with status 1, so it is reported, not hidden.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from dasktrain import _stop
from dasktrain.errors import DasktrainError

__all__ = ["main"]

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, like every other user error
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_cluster(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler", metavar="ADDRESS",
                        help="use the Dask cluster at ADDRESS (default: start a LocalCluster "
                             "on 127.0.0.1)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _storage_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE``; the value is read as JSON where it is JSON (``true``, ``3``, ``{...}``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def _add_storage(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-option", dest="storage_options", action="append",
                        type=_storage_option, default=[], metavar="KEY=VALUE",
                        help="fsspec option for a URL (s3://...), e.g. endpoint_url=http://... "
                             "or anon=true; repeatable")


def _storage(args: argparse.Namespace) -> dict:
    """``storage_options=`` for the library call, when any were given."""
    return {"storage_options": dict(args.storage_options)} if args.storage_options else {}


def _build_parser() -> argparse.ArgumentParser:
    from dasktrain.datasets import builtin_names

    parser = _Parser(prog="dasktrain", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    prep = commands.add_parser(
        "prepare", help="build a dataset from files, a bundled dataset or a generator",
        description="Build a dasktrain Zarr dataset with Dask.")
    prep.add_argument("source", help=f"a .npy/.npz/.csv/.parquet/.txt file or directory, a "
                                     "folder of class sub-folders of images, or one of "
                                     f"{', '.join(builtin_names())}")
    prep.add_argument("out", help="directory or URL (s3://bucket/name.zarr) of the new dataset")
    prep.add_argument("--features", help="comma-separated feature columns (tabular) or the "
                                         "features array name (npz)")
    prep.add_argument("--target", help="target column, npz array name, or .npy file of targets")
    prep.add_argument("--array", dest="arrays", action="append", metavar="NAME[=FROM][:ROLE]",
                      help="write several named arrays instead of --features/--target: an "
                           "npz member (`all` for every one) or a table's column group "
                           "(image=a,b,c), ROLE features, targets or other; repeatable")
    prep.add_argument("--encode-categorical", action="store_true",
                      help="encode non-numeric columns as integer codes instead of refusing")
    prep.add_argument("--samples", type=int, help="samples of a synthetic dataset")
    prep.add_argument("--width", type=int, help="features of a synthetic dataset")
    prep.add_argument("--classes", type=int, help="classes of `classification`")
    prep.add_argument("--noise", type=float, help="noise level of a synthetic dataset")
    prep.add_argument("--text-column", metavar="COLUMN",
                      help="make a token dataset of a CSV/Parquet column of documents")
    prep.add_argument("--text-glob", metavar="PATTERNS",
                      help="files of a directory that are documents of a text corpus, e.g. "
                           "'*.py,!tests/*' (`*` crosses `/`, `!` leaves out; default *.txt)")
    prep.add_argument("--tokenizer", metavar="bytes|PATH",
                      help="tokenizer of a text source: bytes (default) or a tokenizer.json")
    prep.add_argument("--seq-len", type=int,
                      help="tokens per packed sequence of a text source (default 1024)")
    prep.add_argument("--eot-token", metavar="TOKEN",
                      help="end-of-text token of a tokenizer.json (default <|endoftext|>, "
                           "</s>, ... whichever it has)")
    prep.add_argument("--image-storage", choices=["decoded", "encoded"],
                      help="images as uint8 pixels of one size (decoded, the default) or as "
                           "the files' bytes, decoded by the pipeline's transform (encoded)")
    prep.add_argument("--image-size", metavar="N|HxW",
                      help="size of decoded images (default: the median size of 64 files "
                           "spread over the source, read from their headers)")
    prep.add_argument("--image-fit", choices=["center-crop", "stretch"], default="center-crop",
                      help="how an image of another size is brought to --image-size")
    prep.add_argument("--image-column", metavar="COLUMN",
                      help="column of a CSV/Parquet manifest naming image files (found "
                           "unasked when one column's first cell names a .jpg/.png)")
    prep.add_argument("--skip-bad", action="store_true",
                      help="leave out files that are not readable images (counted) instead "
                           "of refusing the source")
    size = prep.add_mutually_exclusive_group()
    size.add_argument("--chunk-rows", type=int, help="samples per chunk")
    size.add_argument("--chunk-size", default="4MiB",
                      help="target bytes per chunk of all arrays (default 4MiB)")
    prep.add_argument("--normalize", action="store_true",
                      help="standardise features with the first split's mean and std")
    prep.add_argument("--split", help="random splits of exact sizes, e.g. train=0.9,val=0.1")
    prep.add_argument("--seed", type=int, default=0, help="seed of splits and generators")
    prep.add_argument("--compression", default="zstd", choices=["zstd", "blosc", "none"])
    prep.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    _add_cluster(prep)
    _add_storage(prep)

    info = commands.add_parser("info", help="print a dataset's schema, sizes and splits")
    info.add_argument("path")
    _add_storage(info)

    check = commands.add_parser("verify", help="read every chunk and check it")
    check.add_argument("path")
    _add_cluster(check)
    _add_storage(check)
    _add_train(commands)
    _add_bench(commands)
    return parser


def _prepare(args: argparse.Namespace) -> int:
    from dasktrain.datasets import PrepareConfig, describe, prepare

    config = PrepareConfig(
        features=args.features, target=args.target, arrays=args.arrays,
        encode_categorical=args.encode_categorical,
        samples=args.samples, width=args.width, classes=args.classes, noise=args.noise,
        text_column=args.text_column, text_glob=args.text_glob, tokenizer=args.tokenizer,
        seq_len=args.seq_len, eot_token=args.eot_token,
        image_storage=args.image_storage, image_size=args.image_size,
        image_fit=args.image_fit, image_column=args.image_column, skip_bad=args.skip_bad,
        chunk_rows=args.chunk_rows, chunk_size=args.chunk_size, normalize=args.normalize,
        split=args.split, seed=args.seed, compression=args.compression,
        overwrite=args.overwrite)
    ds = prepare(args.source, args.out, scheduler=args.scheduler,
                 progress=not args.no_progress, config=config, **_storage(args))
    print(describe(ds))
    return 0


def _info(args: argparse.Namespace) -> int:
    from dasktrain.datasets import describe

    print(describe(args.path, **_storage(args)))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from dasktrain.datasets import verify

    report = verify(args.path, scheduler=args.scheduler, progress=not args.no_progress,
                    **_storage(args))
    for note in report.notes:
        print(f"dasktrain verify: note: {report.url}: {note}", file=sys.stderr)
    if report.ok:
        print(f"ok: {report.url}: {report.chunks_read} chunks read, all checks passed")
        return 0
    for problem in report.problems:
        print(f"dasktrain verify: {report.url}: {problem}", file=sys.stderr)
    return 1


# -- train ---------------------------------------------------------------------------------
class _TrainHelp(argparse.Action):
    """``train --help`` with every config key: the reference is built from the Trainer's
    signature, so it imports torch, which no other command should pay for."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show this help and every "
                         "config key, then exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object
                 ) -> None:
        from dasktrain.cli.train_keys import config_reference

        parser.epilog = config_reference()
        parser.print_help()
        parser.exit()


def _add_train(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train", help="train a model as a TOML config file says, into a run directory",
        description="Train a model as CONFIG.toml says (see examples/digits.toml), writing "
                    "a run directory: config.toml (resolved), metrics.jsonl, checkpoint/, "
                    "model.pt, and the History and its report where available.",
        formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    train.add_argument("-h", "--help", action=_TrainHelp)
    train.add_argument("config", help="the TOML config file")
    train.add_argument("--run-dir", metavar="DIR", help="run directory (default: [run] dir)")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in the run directory from its checkpoint")
    _add_cluster(train)


def _train(args: argparse.Namespace) -> int:
    from dasktrain.cli.train_config import load_train_config
    from dasktrain.cli.train_run import after_stop, run_training
    from dasktrain.trainer.errors import TrainerError

    progress = not args.no_progress
    config = load_train_config(args.config, progress=progress)
    run_dir = args.run_dir or config.run_dir
    try:
        result = run_training(config, run_dir, scheduler=args.scheduler, resume=args.resume,
                              progress=progress)
    except TrainerError as exc:  # diverged, holder lost, workers paused: not a bug
        print(f"dasktrain train: training stopped: {exc} ({after_stop(run_dir, exc)})",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(f"dasktrain train: {_stopped_by(exc)} ({after_stop(run_dir)})", file=sys.stderr)
        return _interrupt_status(exc)
    print(result.summary())
    return 0


_COMMANDS = {"prepare": _prepare, "info": _info, "verify": _verify, "train": _train}


# -- bench: the repository's benchmarks, one table of ratios (dasktrain.cli.bench) -------------
def _add_bench(commands: argparse._SubParsersAction) -> None:
    from dasktrain.cli.bench import BENCHMARKS

    bench = commands.add_parser(
        "bench", help="run the benchmarks and print one table of ratios to their baselines",
        description="Run the benchmarks of a source checkout (benchmarks/*.py), each in its "
                    "own process with its own LocalCluster on 127.0.0.1, and print one table: "
                    "workload, dasktrain's figure, the baseline's, their ratio, the goal. The "
                    "benchmarks' own reports go to stderr.")
    bench.add_argument("--quick", action="store_true",
                       help="run each for seconds: checks that they work, figures are rough")
    bench.add_argument("--only", nargs="+", choices=BENCHMARKS, metavar="NAME",
                       help=f"run only these, among {', '.join(BENCHMARKS)}")
    bench.add_argument("--benchmarks", metavar="DIR",
                       help="directory of the benchmark scripts (default: benchmarks/ of the "
                            "source checkout the package is installed from)")


def _bench(args: argparse.Namespace) -> int:
    from dasktrain.cli.bench import BENCHMARKS, format_table, run_benchmarks

    result = run_benchmarks(args.only or BENCHMARKS, quick=args.quick,
                            directory=args.benchmarks)
    print(format_table(result.rows))
    for name, why in result.failed.items():
        print(f"dasktrain bench: {name} failed: {why} (its report is above)", file=sys.stderr)
    return 1 if result.failed else 0


_COMMANDS["bench"] = _bench


class _Terminated(KeyboardInterrupt):
    """SIGTERM, unwound like Ctrl-C so that the command cleans up after itself."""


def _stopped_by(exc: KeyboardInterrupt) -> str:
    return "terminated" if isinstance(exc, _Terminated) else "interrupted"


def _interrupt_status(exc: KeyboardInterrupt) -> int:
    """128 + the signal's number, as a shell reports a command ended by it."""
    return 128 + (signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT)


class _QuietAfterInterrupt(logging.Filter):
    """Drops the event loop's error reports once Ctrl-C (or SIGTERM) arrived.

    While the run unwinds, callbacks on the client's loop may fail noisily (distributed's
    ``sync`` schedules a cancel that can run before its future exists, and tornado logs the
    NameError with a traceback); the one line the command prints says what happened.
    """

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.interrupted

    def on_signal(self, signum: int, frame: object) -> None:
        # Set before KeyboardInterrupt starts unwinding, so before any cancel is scheduled.
        self.interrupted = True
        stop = _Terminated if signum == signal.SIGTERM else KeyboardInterrupt
        _stop.request(stop)  # raised again before publishing, should this one be swallowed
        raise stop


def _quiet_stops(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """``sys.unraisablehook`` that keeps quiet about our own stop raised where Python
    cannot raise (a garbage-collector callback): :mod:`dasktrain._stop` raises it again
    before anything is published, and the command prints its one line."""
    def unraisable(info: Any) -> None:
        if not isinstance(info.exc_value, KeyboardInterrupt):
            hook(info)

    return unraisable


def _show_warning(command: str) -> Callable[..., None]:
    """``warnings.showwarning`` for the command: one line, no source location."""
    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: object = None, line: str | None = None) -> None:
        print(f"dasktrain {command}: warning: {message}", file=sys.stderr)

    return show


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dasktrain`` command; returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from dasktrain import _cluster

    # The embedded cluster's one line (with its dashboard) goes with the command's output,
    # and so does what a preparation is about to write.
    _cluster.announce = print
    importlib.import_module("dasktrain.datasets.prepare").announce = print
    quiet = _QuietAfterInterrupt()
    _stop.clear()
    loop_errors = logging.getLogger("tornado.application")
    loop_errors.addFilter(quiet)
    previous = {signum: signal.signal(signum, quiet.on_signal)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    unraisable = sys.unraisablehook
    sys.unraisablehook = _quiet_stops(unraisable)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning(args.command)
            return _COMMANDS[args.command](args)
    except KeyboardInterrupt as exc:
        print(f"dasktrain {args.command}: {_stopped_by(exc)}; nothing was written",
              file=sys.stderr)
        return _interrupt_status(exc)
    except (ValueError, OSError, DasktrainError) as exc:
        # Bad input (paths, options, data: DatasetError and SourceError are ValueErrors),
        # or work the cluster could not do as asked (workers killed for their memory).
        # Anything else is a bug of ours: its traceback and exit status 1 get it reported.
        print(f"dasktrain {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = unraisable
        loop_errors.removeFilter(quiet)


if __name__ == "__main__":
    sys.exit(main())
