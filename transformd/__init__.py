"""transformd: MXFP8 checkpoints converted once per node to 128x128 block FP8, cached and served.

Tensors: :func:`convert_weight` (validates, then the fused kernel on a GPU or the
PyTorch reference on the CPU). Checkpoints: :func:`convert_checkpoint`. The cache
is :mod:`transformd.cache`, the daemon and its client :mod:`transformd.api`.
"""

from .checkpoint import CheckpointError, ConversionResult, convert_checkpoint
from .convert import convert_weight, resolve_device
from .formats import FORMAT_VERSION, MxFormatError, ScaleMode, Target, validate_pair
from .reference import convert_reference, dequantize_block, dequantize_mx

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "ConversionResult",
    "MxFormatError",
    "ScaleMode",
    "Target",
    "convert_checkpoint",
    "convert_reference",
    "convert_weight",
    "dequantize_block",
    "dequantize_mx",
    "resolve_device",
    "validate_pair",
]
