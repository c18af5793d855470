"""An OpenAI-compatible HTTP server over the scheduler (FastAPI + uvicorn: the `server` extra).

    python scripts/serve.py -m model.gguf --host 127.0.0.1 --port 8080 -np 8

Modules: schemas (request bodies), openai_format (response shapes), backend (model loading, the
scheduler's thread, admission), metrics (Prometheus text), app (the routes), cli (the flags),
load_test (N concurrent streaming clients against a running server).
"""
