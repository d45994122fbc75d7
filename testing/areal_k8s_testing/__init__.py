"""Test and benchmark support for areal-k8s: what tests, benchmarks and GPU scripts share (testing/pyproject.toml)."""
