"""Sampling controls this project adds to vLLMs (DRY)."""
