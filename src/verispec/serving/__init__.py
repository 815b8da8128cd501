"""`verispec serve`: an OpenAI-compatible server whose every response carries its verification report.

Modules, bottom to top: `config` (settings and the operator's guardrails; no optional dependency),
`schema` (JSON Schemas for /openapi.json), `logprobs` (OpenAI's logprobs shapes), `metrics`
(Prometheus), `engine` (the continuous-batching engine), `app` (request parsing, the FastAPI app,
uvicorn with a draining shutdown), `ray` (the same app as a Ray Serve deployment). `metrics`, `engine`,
`app` and `ray` need the `serve` extra: pip install "verispec[serve]".
"""
