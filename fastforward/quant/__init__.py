"""Weight quantization: packed formats that replace the linear layers of a loaded model.

``quantization=`` names (see ``formats.METHODS``): ``int8`` (per output channel), ``int4`` /
``int4-g64`` / ``int4-g128`` (group-wise scale + zero), ``codebook4`` / ``codebook8`` (k-means
centroids), ``gguf`` (a GGUF file's own blocks, kept packed). Quantized KV cache is not here
yet: it belongs with the KV cache specs (``kv/spec.py``), selected by its own engine option.
"""

from fastforward.quant.formats import METHODS, QuantSpec, parse_quantization

__all__ = ["METHODS", "QuantSpec", "parse_quantization"]
