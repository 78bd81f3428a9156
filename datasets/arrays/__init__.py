"""Arrays read in place: samples as windows over named dimensions of an xarray Dataset, a
Zarr store or dask arrays, with no second copy (see :func:`open_arrays`)."""

from dasktrain.datasets.arrays.dataset import ArrayDataset, open_arrays

__all__ = ["ArrayDataset", "open_arrays"]
