"""Loading a local Hugging Face model, adding LoRA, and wrapping it for DDP or FSDP2."""
