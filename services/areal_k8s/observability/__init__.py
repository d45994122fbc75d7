"""Metrics dashboards as code (the metrics themselves are in areal_k8s.common.metrics)."""
