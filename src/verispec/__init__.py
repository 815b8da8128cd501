"""verispec: speculative decoding that makes the cost of lossy verification visible."""

from __future__ import annotations

from verispec.api import GenerateResult, generate
from verispec.version import __version__

__all__ = ["GenerateResult", "__version__", "generate"]
