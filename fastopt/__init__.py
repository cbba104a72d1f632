"""fastopt: make temporal graph neural network training fast without changing what it learns."""

from fastopt.config import Config, default_config, patch
from fastopt.errors import FastOptError
from fastopt.optimize import optimize

__version__ = "0.1.0"

__all__ = ["Config", "FastOptError", "default_config", "patch", "optimize", "__version__"]
