"""`memfit serve-model`: the champion (or any export) behind an OpenAI-compatible HTTP API."""
