"""memfit: fine-tune language models on the GPU you have, and keep the run alive on spot machines."""

__version__ = "0.1.0"
