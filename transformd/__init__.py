"""transformd: MXFP8 checkpoints converted once per node to 128x128 block FP8, cached and served."""

from .convert import convert_weight, resolve_device
from .formats import FORMAT_VERSION, MxFormatError, ScaleMode, Target, validate_pair
from .reference import convert_reference, dequantize_block, dequantize_mx

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "MxFormatError",
    "ScaleMode",
    "Target",
    "convert_reference",
    "convert_weight",
    "dequantize_block",
    "dequantize_mx",
    "resolve_device",
    "validate_pair",
]
