"""Weight formats: GGUF bytes -> device planes (repack) and planes -> values (decode).

`ggml` holds the bit-exact jnp dequantization of raw GGUF bytes (ground truth, checked against
gguf-py); `planes` holds the device layout every kernel reads and its decode arithmetic.
"""

from minfer_jax.quant.planes import FORMATS, ROW_ALIGN, Format, decode, get_format, repack

__all__ = ["FORMATS", "ROW_ALIGN", "Format", "decode", "get_format", "repack"]
