"""verispec: speculative decoding that makes the cost of lossy verification visible."""

from __future__ import annotations

from verispec.api import GenerateResult, generate

__version__ = "0.1.0"
__all__ = ["GenerateResult", "generate"]
