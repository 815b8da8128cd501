"""verispec: speculative decoding that makes the cost of lossy verification visible."""

from __future__ import annotations

__version__ = "0.1.0"
