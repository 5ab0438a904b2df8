"""Who may ask, and how much: API keys and their file (keys.py), the auth
middleware and failed-auth limiter (auth.py), per-key quotas (quotas.py),
fair admission between keys (admission.py), request-body limits
(limits.py) and the connections each client address may hold
(connections.py); and what each request got: the access log
(access_log.py), whose record the serving room fills.

Knows nothing of models or engines. May import the gateway's config.py and
errors.py, and engines/home.py (where the keys file lives); no other room.
See docs/DESIGN.md, "One request".
"""
