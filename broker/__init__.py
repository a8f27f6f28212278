"""The broker: routes every session's requests to the worker that holds it.

Kept free of imports so that `from broker import protocol` (which worker and client do) stays cheap.
Run it with `broker start` (see broker/cli.py).
"""
