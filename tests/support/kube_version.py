"""The Kubernetes release every rendered manifest is validated against (kubernetes-validate).

One place for the operator's manifests, its CRD and the Helm charts: a release
kubernetes-validate ships schemas for, with CEL fieldPath (1.28+) and the
PodDisruptionBudget unhealthyPodEvictionPolicy (GA in 1.31).
"""

K8S_VERSION = "1.33"
