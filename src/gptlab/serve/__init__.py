"""`gptlab serve`: a run behind an OpenAI-compatible HTTP API, with continuous batching and a playground page.

Rooms: `api` (the request body checked into typed settings, limits, OpenAI's error shape), `metrics` (what
/metrics reports, through prometheus_client), `scheduler` (the thread that owns the model: a `RunningBatch` that
requests join and leave between decode steps, each job's typed events), `responses` (the completions' and chat
completions' answers shaped from those events, JSON or server-sent chunks), `app` (the FastAPI routes, `make_app`),
`server` (`serve_run` serves a checked, loaded run with uvicorn until SIGINT / SIGTERM; `start_server` runs an app
in a thread on a loopback port: the tests and `gptlab bench serve`), `playground.html` (the page at /, one
self-contained file). FastAPI is imported with `responses` and `app` only, on first use, so that the CLI's other
verbs never pay for it. Import the modules themselves: this file imports nothing.
"""
