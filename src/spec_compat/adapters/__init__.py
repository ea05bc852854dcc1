"""The only package that touches vLLM internals (a test enforces it)."""
