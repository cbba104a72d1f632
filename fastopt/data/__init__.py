"""Temporal graphs: the event stream type, loaders for the common formats, a synthetic generator."""

from fastopt.data.graph import TemporalGraph
from fastopt.data.loaders import (builtin_datasets, dataset_cache_dir, load_dataset, load_file,
                                  resolve_dataset, save_npz)

__all__ = ["TemporalGraph", "builtin_datasets", "dataset_cache_dir", "load_dataset", "load_file",
           "resolve_dataset", "save_npz"]
