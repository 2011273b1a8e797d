"""What is applied to a model or a step: checkpointing, offload, lean layers, loss and optimizer variants."""
