"""What the person running the box touches: the `specgate` CLI (cli.py),
service files for launchd and systemd (service.py), the admin page
(status.py, history.py, static/admin.html), the long commands' progress
(engines/progress.py draws it) and `specgate launch` (launch.py: a coding agent run
against this machine's server, configured for it). The Prometheus metrics
are recorded in serving/metrics.py.

The top of the gateway: cli.py may import anything in specgate, builders/
included (lazily, for `demo-model` and `demo-drafter`), and is the only
module that imports app.py. status.py and history.py read access/ and
serving/; app.py serves them.
launch.py reads config, access/ (the keys file) and engines/home.py. See
docs/DESIGN.md, "Observability" and "Coding agents".
"""
