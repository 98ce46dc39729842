"""HTTP server over the engine: OpenAI and Ollama dialects, vLLM-named Prometheus metrics."""
