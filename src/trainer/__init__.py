"""The trainer proper: launch (N local ranks, or under torchrun), the loop (build, step,
validate, checkpoint, finish), faults and signals, samples, and the sweep summary."""
