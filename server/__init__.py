"""vmkv's OpenAI-compatible HTTP server (FastAPI + uvicorn); ``vmkv serve`` starts it."""
