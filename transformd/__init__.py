"""transformd: MXFP8 checkpoints converted once per node to 128x128 block FP8, cached and served.

Tensors: :func:`convert_weight` (validates, then the fused kernel on a GPU or NumPy table
lookups on the CPU).
Checkpoints: :func:`convert_checkpoint`. The cache is :mod:`transformd.cache`, the daemon
:mod:`transformd.daemon`, its client :mod:`transformd.client` (torch-free: what engines import).

Importing the package imports nothing heavy: each name below is loaded on first use, so
``import transformd.client`` costs Python (and httpx once a client is made), not torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names
from ._version import __version__
from .errors import CheckpointError, MxFormatError, TransformdError
from .formats import FORMAT_VERSION, ScaleMode, Target

#: name -> module that defines it (imported on first access).
_LAZY = {
    "ConversionResult": ".checkpoint",
    "convert_checkpoint": ".checkpoint",
    "convert_weight": ".convert",
    "resolve_device": ".convert",
    "validate_pair": ".mx",
    "convert_reference": ".reference",
    "dequantize_block": ".reference",
    "dequantize_mx": ".reference",
    "TransformdClient": ".client",
    "load_tensors": ".loader",
}

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "MxFormatError",
    "ScaleMode",
    "Target",
    "TransformdError",
    "__version__",
    *sorted(_LAZY),
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


if TYPE_CHECKING:  # the lazy names (in __all__ through _LAZY), for type checkers
    from .checkpoint import ConversionResult, convert_checkpoint  # noqa: F401
    from .client import TransformdClient  # noqa: F401
    from .convert import convert_weight, resolve_device  # noqa: F401
    from .loader import load_tensors  # noqa: F401
    from .mx import validate_pair  # noqa: F401
    from .reference import convert_reference, dequantize_block, dequantize_mx  # noqa: F401
