"""Which ready queue of one device runs next.

The rule: the lowest priority rank first (urgent before high before normal
before low), the oldest request first among equal ranks. The bound: a ready
queue passed over `starvation_limit` times in a row is served next, whatever
its priority. With the two default queues, a ready vision batch therefore
waits behind at most `starvation_limit` text batches (4 by default); with n
queues, behind at most `starvation_limit + n - 1` batches.
"""

DEFAULT_STARVATION_LIMIT = 4


class BatchOrder:
    def __init__(self, starvation_limit: int = DEFAULT_STARVATION_LIMIT):
        if not isinstance(starvation_limit, int) or starvation_limit < 1:
            raise ValueError(f"starvation_limit: expected an integer >= 1, got {starvation_limit!r}")
        self.limit = starvation_limit
        self.passed: dict[str, int] = {}    # ready queue -> times passed over in a row

    def pick(self, ready: list[tuple[str, int, int]]) -> str | None:
        """`ready`: (modality, rank, oldest_ns) of each ready queue."""
        if not ready:
            return None
        passed = self.passed
        starving = [r for r in ready if passed.get(r[0], 0) >= self.limit]
        if starving:
            choice = min(starving, key=lambda r: (-passed[r[0]], r[1], r[2]))
        else:
            choice = min(ready, key=lambda r: (r[1], r[2]))
        # A queue that is not ready now has not been passed over: its count restarts.
        self.passed = {m: passed.get(m, 0) + 1 for m, _, _ in ready if m != choice[0]}
        return choice[0]
