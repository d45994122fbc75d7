"""The weight push to the rollout engines: the publisher (the weight-update group and its recovery), the sender (the
buckets over torch.distributed) and the rollout workers as targets (worker_target.py, the protocol; targets.py, its
gRPC client in the trainer's shell)."""
