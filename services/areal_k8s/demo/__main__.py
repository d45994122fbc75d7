"""`python -m areal_k8s.demo --out DIR [--seed N]`: build the demo assets (same as `areal_k8s.demo.build`)."""

from areal_k8s.demo.build import main

main()
