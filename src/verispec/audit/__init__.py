"""`verispec audit`: does a serving engine's output follow the law it claims? (docs/design/diagnostics.md,
'Auditing an engine')."""

from verispec.audit.endpoint import Endpoint, EndpointError, request_fields, setting_name
from verispec.audit.run import AuditConfig, AuditError, load_prompts, render, render_html, run_audit
from verispec.audit.stats import Audit, effects_in_words

__all__ = ["Audit", "AuditConfig", "AuditError", "Endpoint", "EndpointError", "effects_in_words",
           "load_prompts", "render", "render_html", "request_fields", "run_audit", "setting_name"]
