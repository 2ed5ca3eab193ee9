"""The embedded default: a tiny Qwen2-architecture model, its tokenizer and a dataset, all built locally."""
