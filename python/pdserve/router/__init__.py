"""The P/D router: sends each request to a prefill and a decode server at once (with
``bootstrap_host/port/room`` added) and relays the decode server's answer.

``config`` (RouterArgs), ``policy`` (pure worker choice), ``bootstrap`` (pure body rewriting),
``workers`` (worker sets, health checks), ``proxy`` (the forwarding over one connection pool),
``metrics`` and ``app`` (FastAPI routes, start-up wait, signals).
"""
