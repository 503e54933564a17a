"""ClusterConfig: what a simulated cluster is made of, besides its workload."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.sim.cost_model import CostModel
from tandem.sim.deployment import Deployment, RoleSetup
from tandem.sim.devices import Device
from tandem.sim.model_shapes import ModelShape
from tandem.sim.network import Network

# A pod that takes longer than a day to start is not a deployment to simulate.
MAX_STARTUP_S = 86_400.0


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
    # Stop here even if requests remain (they are reported unfinished); inf: never.
    max_time_s: float = math.inf

    def __post_init__(self) -> None:
        # Flags named as `tandem sim` spells them: that is where these come from.
        _seconds("--startup-s", self.startup_s, zero=True)
        if self.startup_s > MAX_STARTUP_S:  # else the run ticks its autoscaler to then
            raise ValueError(
                f"--startup-s must be at most {MAX_STARTUP_S:g} s (a day), got {self.startup_s:g}"
            )
        _seconds("scrape_interval_s", self.scrape_interval_s, zero=False)
        if self.until_s is not None:
            _seconds("--until", self.until_s, zero=True)
        if self.max_time_s != math.inf:  # the default: no limit
            _seconds("--max-time", self.max_time_s, zero=False)
        if self.until_s is not None and self.until_s > self.max_time_s:
            raise ValueError(
                f"--until {self.until_s:g} is past --max-time {self.max_time_s:g}, where the "
                "run stops"
            )
        for setup in self.deployment.roles.values():
            self.kv_blocks(setup)  # a role that cannot hold one request is refused now
            # A pod's data-parallel ranks are processes of one pod, so on one node.
            gpus, node = setup.tp * setup.dp, self.device.gpus_per_node
            if gpus > node:
                raise ValueError(
                    f"{setup.role}: a pod of --tp {setup.tp} x --dp {setup.dp} "
                    f"(dataParallelSize) needs {gpus} devices on one node; a "
                    f"{self.device.name} node has {node}"
                )

    def cost_model(self, tp: int) -> CostModel:
        return CostModel(self.device, self.shape, tp)

    def kv_blocks(self, setup: RoleSetup) -> int:
        """The KV blocks each rank of the role's pods has after the weights."""
        engine = setup.engine
        blocks = self.cost_model(setup.tp).kv_blocks(engine.block_size)
        where = "left after the weights"
        if setup.kv_cache_bytes is not None:  # the pool the engine is told to make
            asked = setup.kv_cache_bytes // (self.shape.kv_bytes_per_token * engine.block_size)
            if asked < blocks:
                blocks, where = asked, "of engine.kvCacheMemory"
        if blocks * engine.block_size < engine.max_model_len:
            raise ValueError(
                f"{setup.role}: the KV cache {where} holds "
                f"{blocks * engine.block_size} tokens, fewer than max_model_len "
                f"{engine.max_model_len}: raise tp or lower max_model_len"
            )
        return blocks


def _seconds(name: str, value: float, *, zero: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
