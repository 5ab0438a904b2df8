"""Constrained decoding with llguidance: the masks a grammar allows per
sequence (matcher.py), the bounds a request's schema must keep before it
reaches the compiler (bounds.py), and the child process that compiles each
request's grammar first, so a native crash or a runaway compile costs a
400, not the gateway (sandbox.py, child.py); a reasoning model's thinking
budget, held as a mask with the answer's grammar after it (thinking.py).

Imports only engines/base.py of the engines; nothing below it. See
docs/DESIGN.md, "Engines" ("Under a grammar") and "Thinking".
"""
