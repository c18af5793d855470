"""Weight formats: GGUF bytes -> values (dequantize), -> device planes (repack), planes -> values
(decode).

`planes` holds every format's one record (`Format`, FORMATS) and those entry points; `ggml` the
bit-exact jnp dequantization of raw GGUF blocks (ground truth, checked against gguf-py); `layout`
and `codebooks` the per-format repack and decode arithmetic the records point to.
"""

from minfer_jax.quant.planes import (
    FORMATS,
    ROW_ALIGN,
    Format,
    decode,
    dequantize,
    get_format,
    repack,
)

__all__ = ["FORMATS", "ROW_ALIGN", "Format", "decode", "dequantize", "get_format", "repack"]
