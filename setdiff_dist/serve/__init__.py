"""Serving: an OpenAI-compatible HTTP server (:mod:`.app`, ``setdiff-serve``) whose scheduler
(:mod:`.scheduler`) adds and retires requests between decoding steps of the inference engine
(:mod:`.batch`: continuous batching)."""
