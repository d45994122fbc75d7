"""The trainer's loop: start (or resume), take a batch, step, push the weights, announce, evaluate, checkpoint."""
