"""Strict-JSON values for what verispec prints and serves: NaN and infinities have no JSON spelling."""

from __future__ import annotations

import math


def json_safe(obj):
    """NaN -> null and +-inf -> "inf"/"-inf", recursively (strict JSON has neither)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
