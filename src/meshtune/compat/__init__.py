"""Configs users bring from other tools (LLaMA-Factory, HF TrainingArguments, Qwen's finetune.py, DeepSpeed)
read as meshtune's own."""
