"""The RLJob operator (kopf): reconciles RLJob custom resources into the services' Kubernetes workloads.

Imported as `areal_k8s.k8s_operator` (the folder is operator/; the name `operator` would shadow the stdlib).
"""
