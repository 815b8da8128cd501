"""Every default the entry points share, in one place: `verispec.generate`, `verispec run`, `verispec bench`
(`SweepSpec`, `run_sweep`) and `verispec serve` (`ServeConfig`) read them from here.

The draft is named the same way everywhere: `AUTO_DRAFT` ("auto") is the target's own default drafter
(`verispec.models.default_draft`: default-draft for the default target, a self-draft for SmolLM2, the
0.5B model for the Qwen 1.5B, prompt lookup otherwise), resolved once the target is known; `NO_DRAFT`
("none", or None in Python) is plain decoding of the target.
"""

from __future__ import annotations

TARGET = "default"
AUTO_DRAFT = "auto"
NO_DRAFT = "none"
RULE = "lossless"
K = 4  # draft tokens per block
AUTO_K_MAX = 8  # the widest block k="auto" (`verispec.speculation`) considers
# k="auto" drafts only where the cost model predicts it at least this much faster than plain decoding: a
# hedge against the model's error (pass timings drift with the context and the load; a server round on
# the int4 Qwen pair that drafted where the model predicted a gain ran at 0.92x plain decoding)
AUTO_MARGIN = 0.1
MAX_NEW_TOKENS = 64
TEMPERATURE = 1.0
BATCH_SIZE = 8  # rows decoded together (generate, run, bench); the server's `max_batch` is its own setting
