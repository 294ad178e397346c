"""The ``ray`` KV backend: shared memory on one node, Ray's object store across nodes.

``transport.py`` is the router's side, ``endpoint.py`` the rank's, ``calls.py`` what one
asks of the other; ``shared_memory.py`` stages and maps payloads, ``wake_channel.py``
lets processes on one node ask an import of each other without a Ray call.
"""
