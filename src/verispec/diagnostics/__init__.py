"""Diagnostics: distances between laws and the shift a verification rule causes (docs/design/diagnostics.md,
section 'Diagnostics')."""

from __future__ import annotations

from verispec.probability import js, kl, max_ratio, tail_mass, tv

__all__ = ["js", "kl", "max_ratio", "tail_mass", "tv"]
