"""meshtune: fine-tune causal LMs (full, LoRA) on one GPU, one node or many nodes with one config."""

__version__ = "0.1.0"
