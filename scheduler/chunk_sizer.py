"""Time-budget chunk sizer (spec section 9, opt-in): how many new prompt positions fit
in a prompt step of at most ``quota_s`` seconds.

A prompt step's cost is modelled over its rows (``q`` new positions after ``c`` cached
ones) as

    cost = a + b * sum(q) + d * sum(q * q) + e * sum(q * c)

(matmuls grow with ``q``; attention with ``q * (q / 2 + c)``), the four coefficients
fitted, non-negative, by least squares to the engine's last ``window`` measured prompt
steps. ``budget(c)`` is then the largest ``q`` whose predicted cost, for a row after
``c`` cached positions, is within the quota: never above 32,768 positions and never
below ``floor`` (a step always makes progress). Until ``min_samples`` steps are
measured, or while no coefficient depends on ``q``, it answers None and the configured
token budget applies. Pure Python, like the rest of the scheduler.
"""

from __future__ import annotations

from collections import deque

MAX_POSITIONS = 32_768
_RIDGE = 1e-9  # relative: keeps the normal equations solvable when features coincide


class ChunkSizer:
    def __init__(self, quota_s: float, floor: int, window: int = 64, min_samples: int = 4):
        if quota_s <= 0:
            raise ValueError(f"quota_s must be > 0, got {quota_s}")
        self.quota_s = quota_s
        self.floor = max(1, floor)
        self.min_samples = min_samples
        self._samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._coef: tuple[float, ...] | None = None
        self._stale = False

    @staticmethod
    def features(rows: list[tuple[int, int]]) -> tuple[float, ...]:
        """(1, sum q, sum q^2, sum q*c) of a step's rows given as (q, c)."""
        return (1.0, float(sum(q for q, _ in rows)), float(sum(q * q for q, _ in rows)),
                float(sum(q * c for q, c in rows)))

    def observe(self, rows: list[tuple[int, int]], seconds: float) -> None:
        """A measured prompt step: its rows as (new positions, cached positions)."""
        if rows and seconds > 0:
            self._samples.append((self.features(rows), seconds))
            self._stale = True

    @property
    def coefficients(self) -> tuple[float, ...] | None:
        """(a, b, d, e) of the current fit, or None before there is one."""
        if self._stale:
            self._coef = _fit_non_negative(list(self._samples)) \
                if len(self._samples) >= self.min_samples else None
            self._stale = False
        return self._coef

    def predict(self, q: int, cached: int) -> float | None:
        coef = self.coefficients
        if coef is None:
            return None
        return sum(w * x for w, x in zip(coef, self.features([(q, cached)]), strict=True))

    def budget(self, cached: int) -> int | None:
        """Largest q within the quota after ``cached`` positions (see the module doc)."""
        coef = self.coefficients
        if coef is None or not any(coef[1:]):
            return None
        if self.predict(MAX_POSITIONS, cached) <= self.quota_s:
            return MAX_POSITIONS
        lo, hi = 0, MAX_POSITIONS  # cost(lo) within the quota (or lo = 0), cost(hi) not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.predict(mid, cached) <= self.quota_s:
                lo = mid
            else:
                hi = mid
        return max(lo, self.floor)


def _fit_non_negative(samples: list[tuple[tuple[float, ...], float]]) -> tuple[float, ...] | None:
    """Least squares with every coefficient >= 0: drop the most negative one and refit
    until none is negative (four features: at most four rounds)."""
    active = [0, 1, 2, 3]
    while active:
        coef = _least_squares(samples, active)
        if coef is None:
            return None
        worst = min(active, key=lambda i: coef[i])
        if coef[worst] >= 0:
            return tuple(coef)
        active.remove(worst)
    return None


def _least_squares(samples, active: list[int]) -> list[float] | None:
    """Ridge-regularised normal equations on the ``active`` features, columns scaled to
    unit size first (sum q^2 is ~1e7 times the intercept)."""
    scale = [max((abs(x[i]) for x, _ in samples), default=0.0) or 1.0 for i in active]
    rows = [[x[i] / s for i, s in zip(active, scale, strict=True)] for x, _ in samples]
    ys = [y for _, y in samples]
    n = len(active)
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    ridge = _RIDGE * max(a[i][i] for i in range(n))
    for i in range(n):
        a[i][i] += ridge
    solution = _solve(a, b)
    if solution is None:
        return None
    coef = [0.0] * 4
    for k, i in enumerate(active):
        coef[i] = solution[k] / scale[k]
    return coef


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
