"""The service time at the target concurrency, learnt from Little's law at whatever load was seen.

An engine's service time grows with its batch: every decode step reads the weights once (a fixed
cost) and does a little more work per running sequence, so a request takes longer on a replica
holding 150 requests than on one holding 10 (docs/autoscaler.md has measured figures). The time
learnt between bursts is the idle one, and sizing a burst with it asks for too few replicas. So
the policy fits service time = a + b x (concurrency per replica) over every observation it learnt
from (exponentially weighted, bounded state: five sums) and reads it at the target concurrency,
where the replicas will run.

Pure and immutable, like the forecasts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceTimeSettings:
    half_life_s: float = 1800.0
    """Weight of an observation halves every half hour: a burst seen 10 minutes ago still counts."""
    min_spread_fraction: float = 0.1
    """The fit is used only once the concurrencies seen spread over this share of the target (std);
    before that the mean service time is all there is."""

    def __post_init__(self) -> None:
        if not self.half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {self.half_life_s}")
        if not 0 < self.min_spread_fraction <= 1:
            raise ValueError(f"min_spread_fraction must be in (0, 1], got {self.min_spread_fraction}")


@dataclass(frozen=True)
class ServiceTimeFit:
    """Exponentially weighted sums of (concurrency per replica c, service time s) pairs."""

    at_s: float
    w: float = 0.0
    c: float = 0.0
    s: float = 0.0
    cc: float = 0.0
    cs: float = 0.0


def fit_update(
    fit: ServiceTimeFit | None, per_replica: float, service_s: float, at_s: float, settings: ServiceTimeSettings
) -> ServiceTimeFit:
    """Fold one (concurrency per replica, service time) observation in."""
    if fit is None:
        fit = ServiceTimeFit(at_s=at_s)
    decay = 0.5 ** (max(0.0, at_s - fit.at_s) / settings.half_life_s)
    return ServiceTimeFit(
        at_s=max(at_s, fit.at_s),
        w=fit.w * decay + 1.0,
        c=fit.c * decay + per_replica,
        s=fit.s * decay + service_s,
        cc=fit.cc * decay + per_replica * per_replica,
        cs=fit.cs * decay + per_replica * service_s,
    )


def service_time_at(fit: ServiceTimeFit | None, per_replica: float, settings: ServiceTimeSettings) -> float | None:
    """The fitted service time at ``per_replica`` concurrency, or None while the load seen is too narrow.

    Two facts of batching engines bound it: the service time never falls as the batch grows, and
    neither does the throughput (c / s). Read at the mean point (c0, s0), for c >= c0 that gives
    s0 <= s(c) <= s0 x c / c0 (and the mirror for c < c0), so a noisy slope cannot run away.
    """
    if fit is None or fit.w <= 0:
        return None
    c0, s0 = fit.c / fit.w, fit.s / fit.w
    var = max(0.0, fit.cc / fit.w - c0 * c0)
    if c0 <= 0 or s0 <= 0 or math.sqrt(var) < settings.min_spread_fraction * per_replica:
        return None
    slope = max(0.0, (fit.cs / fit.w - c0 * s0) / var)
    value = s0 + slope * (per_replica - c0)
    ratio = per_replica / c0
    low, high = s0 * min(1.0, ratio), s0 * max(1.0, ratio)
    return min(max(value, low), high)
