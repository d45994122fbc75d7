"""One training step: the batch chosen within the staleness bound, collated, split into minibatches, packed into
micro-batches, and trained on under the objective of algorithm.py."""
