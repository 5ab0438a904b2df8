"""Serving beyond one process: other specgate nodes as peers (peers.py), the
proxy that routes a request to one (proxy.py), and one model over several
ranks of `mlx.launch` (distributed.py; the lock-step execution itself is
engines/distributed/).

Sits above the APIs it routes: may import api/, serving/, access/, the
gateway's config.py and errors.py, and engines/; not operator/. See
docs/DESIGN.md, "A model over several ranks" and "Several nodes".
"""
