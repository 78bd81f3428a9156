"""The trainer worker's side: one model replica running as a long-lived Dask task.

:mod:`.loop` (the per-epoch task: batches from the pipeline, forward, backward, push),
:mod:`.compute` (the loss, metrics and precision of one batch), :mod:`.steps` (the mode's
half of the loop: what a worker does after each backward) and :mod:`.notices` (warnings
and first-batch checks sent to the driver).
"""
