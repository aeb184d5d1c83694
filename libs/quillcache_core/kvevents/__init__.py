"""Engines' KV-cache events: vLLM's and SGLang's wire format, its decoders (general and typed fast path) and the field facts the sim engine encodes with."""
