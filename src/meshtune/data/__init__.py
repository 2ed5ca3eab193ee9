"""Dataset records → conversations → tokenized, label-masked samples, cached once and shared by all ranks."""
