"""A ModelDeployment deleted while a pass runs: the pass makes no children for it."""

from __future__ import annotations

import kmock
import pytest
from support.kube_api import MODELS
from support.kube_cluster import NAMESPACE, normal_model

from tandem.operator.kube import KubeApi
from tandem.operator.kube_connection import Connection
from tandem.operator.manifests import OperatorDefaults
from tandem.operator.plan_writer import PlanWriter
from tandem.operator.reconcile import plan

pytestmark = pytest.mark.asyncio


async def test_a_model_deleted_after_its_pass_read_it_gets_no_children(cluster):
    # Deleted before kopf's finalizer was on, the garbage collector took its children; a
    # pass that had read it before the deletion found none and made them all again.
    async with kmock.Server(cluster.api) as server:
        writer = PlanWriter(KubeApi(Connection(server=str(server.url))))
        model = await cluster.apply(normal_model())
        defaults = OperatorDefaults(image="engine:1", redis_url="redis://r:6379/0")
        actions = plan(model, [], defaults, now="2026-01-01T00:00:00Z")
        assert actions.creates
        await cluster.api.delete(MODELS, NAMESPACE, "m")

        await writer.apply(model, actions, {})
        assert cluster.children("m") == []
