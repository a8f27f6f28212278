"""The OpenAI-compatible HTTP gateway: `gateway start --broker tcp://HOST:5555 --port 8000`.

One asyncio client of the broker (client.aio.AsyncClient) behind an ASGI app (Starlette on uvicorn): chat
completions and completions, streamed as server-sent events, over live sessions that each conversation resumes
(by `session_id`, or by the prefix of its history), so a turn sends and computes only what is new.

    app.py        the routes                     service.py  a request's turn on the broker
    schema.py     request validation             sessions.py live sessions: by name, by prefix, LRU
    responses.py  OpenAI's response objects      models.py   which models the workers serve
    errors.py     broker codes -> HTTP answers   auth.py     API keys
    metrics.py    Prometheus                     cli.py      `gateway start`
"""
