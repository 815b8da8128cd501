from __future__ import annotations

import sys

from verispec.cli import main

sys.exit(main())
