"""The HTTP surface: the OpenAI and Anthropic APIs, auth, quotas, fair
admission, config, metrics and the `specgate` CLI. Names no engine: it
iterates over engines/registry.py. See docs/DESIGN.md, "One request"."""
