"""`verispec serve`: an OpenAI-compatible server whose every response carries its verification report.

Modules, bottom to top: `config` (settings and the operator's guardrails; no optional dependency),
`metrics` (Prometheus), `engine` (the continuous-batching engine), `app` (request parsing, the FastAPI
app, uvicorn with a draining shutdown), `ray` (the same app as a Ray Serve deployment). Everything but
`config` needs the `serve` extra: pip install "verispec[serve]".
"""
