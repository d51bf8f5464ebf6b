"""The OpenAI-compatible HTTP server behind `vllm serve` (api_server.py builds the app)."""
