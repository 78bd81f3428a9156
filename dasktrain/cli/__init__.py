"""The command line's room: ``dasktrain prepare | info | verify | train | bench``.

:mod:`.main` (argument parsing; each command calls one library function), the run config of
``dasktrain train`` (:mod:`.train_config`, :mod:`.train_keys`, :mod:`.builtin_metrics`,
:mod:`._references`, :mod:`._toml_writer`), one run into its directory (:mod:`.train_run`,
:mod:`.run_dir`) and :mod:`.bench` (the benchmarks' table of ratios).
"""

from dasktrain.cli.main import main

__all__ = ["main"]
