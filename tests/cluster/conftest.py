"""The namespace cluster fixture: `cluster(n, ...)` builds one, and removes it when the test ends.

Every test here is skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import pytest

from tests.cluster.netns import Cluster, unavailable_reason

@pytest.fixture
def cluster():
    """A factory: `c = cluster(3, rate_mbit=1000)`; every cluster it made is destroyed at teardown."""
    if why := unavailable_reason():
        pytest.skip(f"no namespace cluster here: {why}")
    made: list[Cluster] = []

    def make(n: int, **kw) -> Cluster:
        c = Cluster(n, **kw)
        made.append(c)
        c.__enter__()
        return c

    yield make
    for c in reversed(made):
        c.destroy()
