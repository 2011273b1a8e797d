"""Models: loading (local folder, hub id, tiny presets), LoRA and QLoRA, quantization; later the families' specifics."""
