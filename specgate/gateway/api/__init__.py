"""The wire APIs: OpenAI (chat, completions, models), Anthropic (messages)
and Responses request schemas and route handlers, and what turns a request
into a prompt and tokens back into a reply: chat templates (chat.py), tool
calls (tools.py; the Responses tool kinds: responses_tools.py), structured
outputs (structured.py).

Owns the HTTP shapes and nothing behind them: serving/ runs a generation,
access/ says who the caller is. May import serving/, access/, the gateway's
config.py and errors.py, policies/ and engines/ (their types); not cluster/
or operator/. See docs/DESIGN.md, "One request".
"""
