"""The HTTP surface, in rooms that each own one concern:

- api/: the OpenAI, Anthropic and Responses wire shapes and handlers;
- access/: keys, auth, quotas, fair admission, body limits;
- serving/: models from config to engine, generation, metrics;
- cluster/: peers, the proxy to them, distributed ranks;
- operator/: the CLI, service files, the admin page.

At the top, config.py (the YAML, typed once) and errors.py (errors in each
API's shape) import no room and every room may import them; app.py
composes the routes of every room, and only operator/cli.py imports it.
Each room's docstring says what it may import (tests/test_layering.py holds
them). The gateway names no engine: it iterates over engines/registry.py.
May import policies/ and engines/, never the other way. See docs/DESIGN.md,
"Layers" and "One request".
"""
