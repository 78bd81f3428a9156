"""Real datasets that ship inside installed packages: no network needed."""

from __future__ import annotations

import dask.array as da
import numpy as np

from dasktrain.datasets.sources.base import ArraySpec, SourceOptions, register_builtin

__all__ = ["DigitsSource"]


class DigitsSource:
    """scikit-learn's handwritten digits: 1,797 8x8 images as 64 features, labels 0-9."""

    known_finite = True

    def __init__(self, name: str, options: SourceOptions):
        from sklearn.datasets import load_digits

        bunch = load_digits()
        self._x = bunch.data.astype(np.float32)
        self._y = bunch.target.astype(np.int64)
        self.num_samples = len(self._y)
        self.specs = {
            "x": ArraySpec("features", np.dtype("float32"), (self._x.shape[1],)),
            "y": ArraySpec("targets", np.dtype("int64"), ()),
        }
        self.labels = {"y": [str(c) for c in bunch.target_names]}
        self.provenance = {"kind": "bundled", "name": "digits",
                           "origin": "sklearn.datasets.load_digits (UCI ML hand-written digits)"}

    def to_dask(self, chunk_rows: int) -> dict[str, da.Array]:
        # Unnamed, dask keys these on a hash of the arrays' contents.
        return {"x": da.from_array(self._x, chunks=(chunk_rows, self._x.shape[1])),
                "y": da.from_array(self._y, chunks=(chunk_rows,))}

    def block_reader(self) -> None:
        return None  # in memory and one chunk by default: reading through to_dask costs nothing


register_builtin("digits")(DigitsSource)
