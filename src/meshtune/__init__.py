"""meshtune: fine-tune causal LMs (full, LoRA, Q-LoRA) on one GPU, one node or many nodes with one config."""

import logging
import os

__version__ = "0.1.0"


class _DropTorchaoImportNoise(logging.Filter):
    """torchao is installed for Q-LoRA, and peft and transformers import it whenever it is present. At import, it
    says it skips its compiled kernels (as set below), and newer torch logs a deprecation warning for each enum it
    registers with pytree. Those lines say nothing to a user."""

    NOISE = ("register_constant() on Enum subclasses", "Skipping import of cpp extensions")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in self.NOISE)


# Q-LoRA uses torchao's NF4 tensor, which is pure Python. torchao's compiled kernels (other quantization schemes)
# fail to load against a torch build they were not made for, with an error line for each .so: not loaded at all.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
for _name in ("torch.utils._pytree", "torchao"):
    logging.getLogger(_name).addFilter(_DropTorchaoImportNoise())
