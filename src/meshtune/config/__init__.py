"""The training config: one YAML file plus `key=value` overrides, validated before any process group exists.

Key names follow Hugging Face TrainingArguments and LLaMA-Factory where one exists, so users can bring their
configs. Every error names the key, the value and what is allowed.

The keys stay flat for users (and for what compat/ translates); in the code each section is a model of its own
(model.py, data.py, preference.py, optimization.py, speed.py, parallel.py, launch.py, output.py) with the checks that
read only its keys. `TrainConfig` (train_config.py) inherits them all and runs the checks across sections, rules.py.
"""

from meshtune.config.autos import template_choice, torchrun_nproc, without_autos
from meshtune.config.chat_formats import TEMPLATE_NAMES
from meshtune.config.data import DATA, TEXT_FORMAT, UNPAIRED_FORMAT
from meshtune.config.launch import LAUNCH
from meshtune.config.model import MODEL, OTHER_STAGES, STAGES_TRAINED
from meshtune.config.optimization import OPTIMIZATION
from meshtune.config.output import OTHER_TRACKERS, OUTPUT, TRACKERS, WATCH
from meshtune.config.parallel import CROSS_NODE, PARALLELISM
from meshtune.config.preference import DPO_ONLY, KTO_ONLY, PREF_LOSSES, PREFERENCE
from meshtune.config.section import FP32_MAX, JOB, MATH, NODE, Section
from meshtune.config.speed import SPEED
from meshtune.config.train_config import TrainConfig, build_config, describe_keys, key_default, math_hash
from meshtune.config.yaml_files import load_yaml, parse_overrides

__all__ = [
    "CROSS_NODE", "DATA", "DPO_ONLY", "FP32_MAX", "JOB", "KTO_ONLY", "LAUNCH", "MATH", "MODEL", "NODE", "OPTIMIZATION",
    "OTHER_STAGES", "OTHER_TRACKERS", "OUTPUT", "PARALLELISM", "PREFERENCE", "PREF_LOSSES", "SPEED", "STAGES_TRAINED",
    "TEMPLATE_NAMES", "TEXT_FORMAT", "TRACKERS", "UNPAIRED_FORMAT", "WATCH", "Section", "TrainConfig", "build_config",
    "describe_keys", "key_default", "load_yaml", "math_hash", "parse_overrides", "template_choice", "torchrun_nproc",
    "without_autos",
]
