"""Quantized weights: MXFP4, NVFP4, MXFP8 and FP8.

- `codes.py`: element and scale codes (e2m1, e4m3, e8m0), rounding and saturation, FP4 nibble packing.
- `formats.py`: each format's quantize and its plain-torch dequantize, the reference every kernel is checked against.
- `tensors.py`: a quantized linear's checkpoint tensors per layout (compressed-tensors, ModelOpt) and
  `QuantizedWeight`, the in-memory form the reference model reads through `dequantize()`.
- `quantize.py`: `kestrel quantize`, a bf16 checkpoint -> a quantized one, shard by shard.
"""

from kestrel.quant.tensors import QuantizedWeight

__all__ = ["QuantizedWeight"]
