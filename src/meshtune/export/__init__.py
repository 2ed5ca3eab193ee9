"""`meshtune export`: training outputs as PEFT adapters or merged Hugging Face models."""
