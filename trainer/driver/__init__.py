"""The driver's side: the process that calls ``fit`` and never touches a gradient.

:mod:`.trainer` (``Trainer``: arguments, fit, evaluate, predict, save and load),
:mod:`.run` (one fit on a cluster: the holder placed, worker tasks epoch by epoch, watched),
:mod:`.watch` (noticing a cluster on which nothing can run), :mod:`.checkpoint`,
:mod:`.update_log` and :mod:`.files` (what a run writes, atomically) and :mod:`.inference`
(prediction and evaluation spread over the cluster).
"""
