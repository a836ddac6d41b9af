"""Training: the DeepSpeed engine over the megatron-core model, the loop, metrics,
checkpoints and signals."""
