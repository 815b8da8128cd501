"""The package version, in one place (the server's /version, `verispec.__version__`)."""

from __future__ import annotations

__version__ = "0.1.0"
