"""ClusterConfig: what a simulated cluster is made of, besides its workload."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.sim.cost_model import CostModel
from tandem.sim.deployment import Deployment
from tandem.sim.devices import Device
from tandem.sim.model_shapes import ModelShape
from tandem.sim.network import Network


@dataclass(frozen=True)
class ClusterConfig:
    deployment: Deployment
    device: Device
    shape: ModelShape
    network: Network = field(default_factory=Network)
    # Seconds from a scale-up decision to the pod taking work (scheduling, weights).
    startup_s: float = 120.0
    # How often the autoscaler evaluates (operator.scrapeInterval; HPA's 15 s).
    scrape_interval_s: float = 15.0
    # Simulate (the autoscaler included) at least until this time; None: until
    # the last request ended.
    until_s: float | None = None
    # Stop here even if requests remain (they are reported unfinished).
    max_time_s: float = math.inf

    def __post_init__(self) -> None:
        for name in ("startup_s", "scrape_interval_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "scrape_interval_s" and not value):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if self.until_s is not None and not self.until_s >= 0:
            raise ValueError(f"until_s must be >= 0, got {self.until_s!r}")

    def cost_model(self, tp: int) -> CostModel:
        return CostModel(self.device, self.shape, tp)
