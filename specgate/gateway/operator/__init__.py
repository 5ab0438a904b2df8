"""What the person running the box touches: the `specgate` CLI (cli.py),
service files for launchd and systemd (service.py) and the status page
(status.py, static/). The Prometheus metrics are recorded in
serving/metrics.py.

The top of the gateway: cli.py may import anything in specgate, builders/
included (lazily, for `demo-model` and `demo-drafter`), and is the only
module that imports app.py. status.py reads serving/ only; app.py serves it.
See docs/DESIGN.md, "Observability".
"""
