"""The weight push to the rollout engines: the publisher (the weight-update group and its recovery), the sender (the
buckets over torch.distributed) and the targets (the rollout workers, over gRPC)."""
