"""What a person sees of a fit: its record, figures, report, live view, and the user's own
code run per update and per epoch.

:mod:`.history` (``History``), :mod:`.plots` and :mod:`.compare` (figures of one run and of
several), :mod:`.report` (PNG figures and one HTML page), :mod:`.live` and
:mod:`.live_page` (a live view in the browser), :mod:`.callbacks` (``Callback``, early
stopping, checkpoints, learning-rate plateaus) and :mod:`.loggers` (JSON lines,
TensorBoard, MLflow).
"""
