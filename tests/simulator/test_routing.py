import itertools
from types import SimpleNamespace

from pdserve.router.routing import decode_key
from pdserve.simulator.routing import decode_order


def test_decode_order_is_the_routers_key_negated():
    for free, pending, inflight, assigned, uid in itertools.product(
            (0, 7, 500), (0, 3), (0, 2), (0, 9), (0, 4)):
        rank = SimpleNamespace(free_blocks=free, pending_imports=pending,
                               inflight=set(range(inflight)), assigned=assigned, uid=uid,
                               cached_prefix_blocks=lambda hashes: 0)
        assert decode_order(rank) == tuple(-x for x in decode_key(rank))
