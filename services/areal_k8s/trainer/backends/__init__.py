"""The training backends behind the `TrainEngine` seam (engine.py), one per `trainer.backend`: `torch`, `megatron`."""
