"""Serving: an OpenAI-compatible HTTP server (:mod:`.app`, ``setdiff-serve``) whose scheduler
(:mod:`.scheduler`) adds and retires requests between decoding steps of the inference engine
(:mod:`.batch`: continuous batching). Rank 0 decodes; the HTTP server runs in a process of its
own (:mod:`.http_process`), the two talking over a pipe (:mod:`.pipe`) in the typed messages of
:mod:`.messages`; each request's text is made on the HTTP side (:mod:`.text`)."""
