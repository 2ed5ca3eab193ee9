"""cpu_offload: FSDP2's CPUOffloadPolicy under zero2 / zero3 / hsdp. The run plan says what it moves to host memory
and how much; two real gloo ranks train zero3 with and without it, full and LoRA, to the same losses, and a
checkpoint written with it resumes without it (and back). On CPU the offload saves nothing, every tensor being in
host memory already, but FSDP2's offload path runs: its copies, its gradient hand-off and the optimizer stepping
the host shards (tests/test_cuda_paths.py runs it on a GPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

from conftest import base_config
from meshtune.config import build_config
from meshtune.distributed import DistEnv
from meshtune.model.parallel import offload_policy
from meshtune.plan import ModelSize, resolve
from meshtune.train.loop import train
from ranks import run_ranks


def env(world_size: int, device: str, local_world_size: int | None = None) -> DistEnv:
    return DistEnv(0, world_size, 0, local_world_size or world_size, torch.device(device))


def config(**values):
    return build_config({"model_name_or_path": "/m", "dataset": "d.jsonl", "parallel": "zero3", "cpu_offload": True,
                         "fsdp_blocks_per_unit": 1, **values})


SEVEN_B = ModelSize(7_000_000_000, 230_000_000)


def test_the_plan_says_what_goes_to_host_memory_and_how_much(monkeypatch):
    monkeypatch.setattr("meshtune.plan.smallest_gpu_memory", lambda device, limit: 141e9)  # an H200, on a CPU host
    full = resolve(config(finetuning_type="full"), env(8, "cuda"), None, lambda: SEVEN_B)
    plain = resolve(config(finetuning_type="full", cpu_offload=False), env(8, "cuda"), None, lambda: SEVEN_B)
    assert full.cpu_offload and not plain.cpu_offload and "cpu_offload" not in plain.describe()
    # 16 bytes a parameter (fp32 weights, gradients, two Adam moments), 1/8 of them on each of 8 processes
    assert "gradients and optimizer state in pinned host memory, ~104.3 GiB a node" in full.why["cpu_offload"]
    assert "cpu_offload                  on  (FSDP2 CPUOffloadPolicy" in full.describe()
    # the optimizer steps host tensors: torch's fused AdamW has a CPU kernel (several times its foreach path)
    assert full.fused_adamw and "fused CPU kernel" in full.why["optim"]
    lora = resolve(config(finetuning_type="lora"), env(8, "cuda"), None, lambda: SEVEN_B)
    assert "the shards' weights in pinned host memory, ~26.1 GiB a node" in lora.why["cpu_offload"]  # frozen: 4 bytes
    # hsdp: each process holds 1/4 of the model (the shard group), 2 nodes of 4
    hsdp = resolve(config(finetuning_type="full", parallel="hsdp"), env(8, "cuda", 4), None, lambda: SEVEN_B)
    assert "~104.3 GiB a node" in hsdp.why["cpu_offload"]
    # the plan's one estimate of the state: master_weights: bf16 holds 8 bytes a parameter, half of fp32's
    bf16 = resolve(config(finetuning_type="full", master_weights="bf16"), env(8, "cuda"), None, lambda: SEVEN_B)
    assert "~52.2 GiB a node" in bf16.why["cpu_offload"]
    on_cpu = resolve(config(finetuning_type="full"), env(2, "cpu"), None, lambda: SEVEN_B)
    assert on_cpu.cpu_offload and "saves nothing" in on_cpu.why["cpu_offload"]
    assert not on_cpu.fused_adamw and on_cpu.why["optim"] == "auto: fused on CUDA"


def test_the_policy_pins_host_memory_on_cuda_only():
    assert type(offload_policy(False, torch.device("cuda", 0))) is OffloadPolicy
    assert offload_policy(True, torch.device("cuda", 0)) == CPUOffloadPolicy(pin_memory=True)
    assert offload_policy(True, torch.device("cpu")) == CPUOffloadPolicy(pin_memory=False)  # pinning needs a GPU


def offload_job(rank: int, world_size: int, workdir: Path) -> None:
    """Every run of task.json in turn, in one pair of processes (torch and the model code imported once)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # what torchrun sets; the process group already exists
    results = {}
    for name, values in json.loads((workdir / "task.json").read_text()).items():
        result = train(build_config(values))
        offloaded = [param.offload_to_cpu for module in result.model.modules() if isinstance(module, FSDPModule)
                     for param in module._get_fsdp_state()._fsdp_param_group.fsdp_params]  # private: no accessor
        results[name] = {"records": result.records, "offloaded": offloaded}
    if rank == 0:
        (workdir / "results.json").write_text(json.dumps(results))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo ranks train on the CPU; with CUDA, "
                    "tests/test_cuda_paths.py runs the offload on the GPU")
@pytest.mark.slow
def test_zero3_trains_the_same_with_and_without_offload_and_resumes_across_it(tmp_path, tiny_model_dir,
                                                                              tiny_dataset):
    def run(name: str, method: str = "full", **extra) -> dict:
        return base_config(tiny_model_dir, tiny_dataset, tmp_path / name, finetuning_type=method, parallel="zero3",
                           nproc_per_node=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                           learning_rate=5e-3 if method == "lora" else 1e-3, max_steps=4, val_size=6,
                           per_device_eval_batch_size=2, tokenized_path=str(tmp_path / "tokenized"),
                           fsdp_blocks_per_unit=1, **extra)

    runs = {
        "full": run("full", save_steps=2),
        "full_offload": run("full_offload", save_steps=2, cpu_offload=True),
        # each resumes the other's checkpoint at step 2 (cpu_offload is not part of the run's math)
        "offload_resumed": run("offload_resumed", save_final=False, cpu_offload=True,
                               resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2")),
        "resumed": run("resumed", save_final=False,
                       resume_from_checkpoint=str(tmp_path / "full_offload" / "checkpoint-2")),
        # what a GPU run picks: torch's fused AdamW, here stepping the host shards on the CPU
        "fused_offload": run("fused_offload", save_final=False, cpu_offload=True, optim="adamw_torch_fused"),
        "lora": run("lora", "lora", save_final=False),
        "lora_offload": run("lora_offload", "lora", save_final=False, cpu_offload=True),
    }
    (tmp_path / "task.json").write_text(json.dumps(runs))
    run_ranks(offload_job, 2, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())

    def losses(name: str) -> list[float]:
        return [(r["step"], r["loss"], r["grad_norm"], r.get("eval_loss")) for r in results[name]["records"]]

    for plain, offloaded in (("full", "full_offload"), ("lora", "lora_offload")):
        assert results[offloaded]["offloaded"] and all(results[offloaded]["offloaded"])
        assert not any(results[plain]["offloaded"])
        assert losses(offloaded) == losses(plain), offloaded  # the same float operations in the same order
        assert [r["step"] for r in results[plain]["records"]] == [1, 2, 3, 4]
    assert losses("full")[3][1] < losses("full")[0][1]
    assert json.loads((tmp_path / "full_offload" / "run_plan.json").read_text())["cpu_offload"]
    assert losses("offload_resumed") == losses("full")[2:] and losses("resumed") == losses("full")[2:]
    assert json.loads((tmp_path / "fused_offload" / "run_plan.json").read_text())["fused_adamw"]
    fused = [value for record in losses("fused_offload") for value in record[1:3]]  # another kernel: other rounding
    assert fused == pytest.approx([value for record in losses("full") for value in record[1:3]], rel=1e-5)
    # final/ gathered from the host shards holds the same weights
    plain, offloaded = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("full", "full_offload"))
    assert plain.keys() == offloaded.keys() and all(torch.equal(plain[k], offloaded[k]) for k in plain)


def test_lora_under_zero2_runs_as_ddp_and_the_plan_says_nothing_is_offloaded():
    """DeepSpeed's ZeRO-2 offload with LoRA (LLaMA-Factory's ds_z2_offload_config.json): LoRA's zero2 runs as ddp,
    where FSDP2 has no shards to offload; the plan says off and why, and the optimizer is not told it steps host
    tensors."""
    from meshtune.compat.job_config import load_job_config

    ds = Path(__file__).parent / "fixtures" / "compat" / "llamafactory" / "examples" / "deepspeed"
    loaded = load_job_config(None, ["model_name_or_path=/m", "dataset=d.jsonl", "finetuning_type=lora",
                                    f"deepspeed={ds / 'ds_z2_offload_config.json'}"])
    assert (loaded.config.parallel, loaded.config.cpu_offload) == ("zero2", True)
    assert any("offload_optimizer under ZeRO stage 2 with LoRA: nothing is offloaded" in line
               for line in loaded.warnings), loaded.warnings
    plan = resolve(loaded.config, env(2, "cuda"), None, lambda: SEVEN_B)
    assert (plan.parallel, plan.cpu_offload) == ("ddp", False)
    assert "cpu_offload                  off  (zero2 with lora runs as ddp, where FSDP2's offload has no shards" \
        in plan.describe()
    assert plan.why["optim"] == "auto: fused on CUDA"
    full = load_job_config(None, ["model_name_or_path=/m", "dataset=d.jsonl", "finetuning_type=full",
                                  f"deepspeed={ds / 'ds_z2_offload_config.json'}"])
    assert any("offload_optimizer → cpu_offload: FSDP2 keeps" in line for line in full.warnings), full.warnings
