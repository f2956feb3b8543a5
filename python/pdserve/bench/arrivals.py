"""When requests are sent: Poisson or gamma-distributed arrivals, as sglang's and vLLM's clients.

Inter-arrival gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): mean
1/rate whatever the burstiness; burstiness 1 is a Poisson process, < 1 burstier,
> 1 more regular. The first request goes at time 0 (sglang sends it before the
first sleep). An infinite rate sends everything at once.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Send times of ``n`` requests in seconds from the start, non-decreasing, the first at 0."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"--request-rate and --burstiness must be > 0, got {rate} and {burstiness}")
    if math.isinf(burstiness):  # the limit: perfectly regular arrivals
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
