"""The training backends behind the `TrainBackend` seam (backend.py), one per `trainer.backend`: `torch`, `megatron`."""
