"""The ``in_process`` KV backend: ranks that live in one process (tests, offline use).
Its rank side is the base ``RankEndpoint``; ``transport.py`` is the router's."""
