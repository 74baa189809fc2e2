"""The OpenAI-compatible HTTP server (`bullet serve`) and its Prometheus metrics."""
