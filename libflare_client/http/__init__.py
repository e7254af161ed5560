"""flare-http: the OpenAI/Anthropic-compatible HTTP shim, a client of the daemon."""
