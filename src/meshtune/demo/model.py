"""A tiny random-init Qwen2 model, and greedy answers from it, for the demo and the tests.

There is no pretrained model to download, so the demo builds one: the Qwen2 architecture, small enough that LoRA
fine-tuning on two CPU cores takes seconds, saved exactly as a hub checkpoint is so that it goes through the same
`from_pretrained` path as a real model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

# initializer_range is 5x Qwen2's 0.02 because the lm_head stays frozen at its random init: with 0.02 its logits
# cannot grow past a few units, so the loss stalls near 3.7 even when the argmax answer is right; 0.1 lets LoRA drive
# it towards 0, as a pretrained head would.
TINY_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.1,
)


def build_tiny_model(tokenizer: PreTrainedTokenizerBase, out_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-init `Qwen2ForCausalLM` sized for `tokenizer`, plus the tokenizer, into `out_dir`.

    `overrides` replace fields of `TINY_CONFIG` (or any other Qwen2Config field). The weights depend only on
    `seed`: the global torch RNG is forked, so the caller's random state is left as it was.
    """
    config = Qwen2Config(
        **{"tie_word_embeddings": False, **TINY_CONFIG, **overrides},
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        # Qwen2's tokenizer has no bos token; its config names <|endoftext|>, which is our pad token.
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def chatml_prompt(user: str) -> str:
    """The ChatML text the model sees before it answers `user` (no system message, generation prompt added)."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@torch.no_grad()
def generate_answers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_new_tokens: int = 8
) -> list[str]:
    """Greedy-decode the assistant's answer to each user prompt, up to `<|im_end|>`, stripped.

    A plain loop over full forward passes rather than `generate()`: prompts are short, and it behaves the same
    for a plain and a peft model whatever the saved generation config says. The model's train/eval mode is
    restored afterwards.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    stop = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    answers = []
    for prompt in prompts:
        ids = tokenizer(chatml_prompt(prompt), add_special_tokens=False, return_tensors="pt").input_ids.to(device)
        new: list[int] = []
        for _ in range(max_new_tokens):
            next_id = int(model(input_ids=ids).logits[0, -1].argmax())
            if next_id in stop:
                break
            new.append(next_id)
            ids = torch.cat([ids, ids.new_tensor([[next_id]])], dim=1)
        answers.append(tokenizer.decode(new, skip_special_tokens=True).strip())
    model.train(was_training)
    return answers
