"""The driver's side: the process that calls ``fit`` and never touches a gradient.

:mod:`.trainer` (``Trainer``, the thin public class), :mod:`.settings` (argument checks and
the settings as plain data), :mod:`.fitting` (the body of ``fit``: epochs, validation,
checkpoints, callbacks), :mod:`.run` (one fit on a cluster: the holder placed, worker tasks
epoch by epoch, watched), :mod:`.resume`, :mod:`.epoch_records`, :mod:`.persistence` (save
and load), :mod:`.watch` (noticing a cluster on which nothing can run), :mod:`.checkpoint`,
:mod:`.update_log` and :mod:`.files` (what a run writes, atomically) and :mod:`.inference`
(prediction and evaluation spread over the cluster).
"""
