from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

# Property tests are derandomised (fixed examples) so CI is reproducible; set
# VERISPEC_HYPOTHESIS=explore locally to search new examples.
settings.register_profile("ci", derandomize=True, max_examples=60, deadline=None, print_blob=True)
settings.register_profile("explore", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("VERISPEC_HYPOTHESIS", "ci"))
