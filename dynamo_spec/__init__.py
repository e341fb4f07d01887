"""dynamo-spec: serve an LLM with EAGLE-3 speculative decoding on vLLM."""

__version__ = "0.1.0"
