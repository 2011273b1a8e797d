"""Training (phase 3): the one loop, the strategies it runs under (one process, DDP, FSDP2, DeepSpeed ZeRO)."""
