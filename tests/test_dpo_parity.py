"""stage: dpo against TRL's own code, end to end on CPU in fp32: pairs read and tokenized by meshtune, collated by
TRL's DataCollatorForPreference and by meshtune's objective, and the loss, the rewards TRL logs and every gradient
compared; the reference is TRL's own (the adapters disabled for LoRA, a ref_model for full fine-tuning) beside
meshtune's (model/reference.py). simpo and orpo go through CPOTrainer's and ORPOTrainer's concatenated forward.
trl is a test-only dependency."""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from types import MethodType, SimpleNamespace

import pytest
import torch

from meshtune.data.pairs import load_or_build_pairs, response_start
from meshtune.data.registry import resolve
from meshtune.distributed import DistEnv
from meshtune.model.loading import load_model
from meshtune.model.model_dir import load_tokenizer
from meshtune.model.reference import AdaptersOff, FrozenCopy
from meshtune.train.objectives import normalised
from meshtune.train.objectives.pair_loss import PairLoss
from meshtune.train.objectives.preference import METRICS, PreferenceSettings, metrics

trl = pytest.importorskip("trl")

CPU_ENV = DistEnv(0, 1, 0, 1, torch.device("cpu"))
CPU = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t,
                      unwrap_model=lambda m: m)
PROMPTS = ["the quick brown fox", "seven small birds sing about rain", "a lazy dog near our old house"]
CHOSEN = ["the sun and wind", "in the green valley near the house", "jumps over"]
REJECTED = ["rain rain rain rain rain", "birds", "the old dog sleeps while seven birds sing about the sun"]


@pytest.fixture(scope="module")
def pairs(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pairs")
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n"
                            for p, c, r in zip(PROMPTS, CHOSEN, REJECTED)))
    tokenizer = load_tokenizer(tiny_model_dir)
    data = load_or_build_pairs(resolve([str(path)], folder), tokenizer, template=None, cutoff_len=256,
                               skip_invalid=False, cache_dir=folder / "cache", show_progress=False)
    return data, tokenizer


def trl_inputs(data, pad_id: int) -> dict:
    """TRL's collator on the same token ids: prompt, chosen and rejected ids split where the response starts."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    examples = []
    for i in range(len(data)):
        (chosen, chosen_labels), (rejected, rejected_labels) = data[i]
        start, other = response_start(chosen_labels), response_start(rejected_labels)
        assert list(chosen[:start]) == list(rejected[:other])  # one prompt, rendered alike before both
        examples.append({"prompt_ids": [int(t) for t in chosen[:start]], "chosen_ids": [int(t) for t in chosen[start:]],
                         "rejected_ids": [int(t) for t in rejected[other:]]})
    return DataCollatorForPreference(pad_token_id=pad_id)(examples)


def trl_dpo_loss(model, ref_model, loss_type: str, beta: float, inputs: dict):
    """DPOTrainer._compute_loss as a trainer on this model runs it, its reference computed in the step."""
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model, outputs=outputs)
    if ref_model is not None:
        add_fused_lm_head(ref_model)
    trainer = SimpleNamespace(model=model, ref_model=ref_model, accelerator=CPU, aux_loss_enabled=False,
                              ld_alpha=None, precompute_ref_logps=False, f_divergence_type="reverse_kl",
                              loss_types=[loss_type], loss_weights=[1.0], beta=beta, use_weighting=False,
                              label_smoothing=0.0, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                              _total_train_tokens=0, _tp_size=1,
                              args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    loss = DPOTrainer._compute_loss(trainer, model, inputs, False)
    mode = "train" if model.training else "eval"
    return loss, {name: values[-1] for name, values in trainer._metrics[mode].items()}


def lora_model(model_dir):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = get_peft_model(load_model(model_dir, torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():  # B away from zero: the policy differs from the reference, the adapters disabled
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    return model


def full_models(model_dir):
    reference = load_model(model_dir, torch.float32)
    policy = copy.deepcopy(reference)
    torch.manual_seed(4)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return policy, reference.requires_grad_(False)


def compare(mine, theirs, mine_loss, their_loss):
    torch.testing.assert_close(mine_loss, their_loss, rtol=1e-5, atol=1e-5)
    mine_loss.backward()
    their_loss.backward()
    graded = 0
    for (name, param), other in zip(mine.named_parameters(), theirs.parameters()):
        if param.requires_grad:
            # within 1e-5 of the gradient's scale: TRL's fused head sums each row's log-probs in other chunks
            scale = other.grad.abs().max().item()
            assert (param.grad - other.grad).abs().max().item() <= 1e-5 * scale + 1e-8, name
            graded += param.grad.abs().sum().item() > 0
    assert graded


def meshtune_loss(objective: PairLoss, data):
    batch = objective.collate([[i] for i in range(len(data))], data, packed=False)
    total = objective.loss_sum(batch)
    count = objective.count(batch)
    return normalised(total, count), metrics(objective.metric_sums(batch), count), batch


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_dpo_loss_rewards_and_gradients_equal_trls_dpo_trainer(pairs, tiny_model_dir, method, loss_type):
    data, tokenizer = pairs
    beta = 0.02 if loss_type == "hinge" else 0.1  # hinge: a margin inside the hinge, so a gradient flows
    if method == "lora":
        mine = lora_model(tiny_model_dir)
        theirs, their_ref = copy.deepcopy(mine), None
        reference = AdaptersOff(mine)
    else:
        mine, ref = full_models(tiny_model_dir)
        theirs, their_ref = copy.deepcopy(mine), copy.deepcopy(ref)
        reference = FrozenCopy(ref, "a frozen copy")
    objective = PairLoss(mine, CPU_ENV, tokenizer.pad_token_id, PreferenceSettings(loss_type, beta), reference)
    got, reported, batch = meshtune_loss(objective, data)
    inputs = trl_inputs(data, tokenizer.pad_token_id)
    assert torch.equal(batch.input_ids, inputs["input_ids"]) and torch.equal(batch.attention_mask,
                                                                            inputs["attention_mask"])
    want, logged = trl_dpo_loss(theirs, their_ref, loss_type, beta, inputs)
    for name in METRICS:
        assert reported[name] == pytest.approx(logged[name], rel=1e-5, abs=1e-5), name
    assert abs(reported["rewards/margins"]) > 1e-4  # the policy is not the reference
    compare(mine, theirs, got, want)


def cpo_like(trainer_class, model, **fields):
    """A CPOTrainer / ORPOTrainer as its get_batch_loss_metrics runs it, on CPU."""
    trainer = SimpleNamespace(is_encoder_decoder=False, pad_token_id=0, aux_loss_enabled=False, accelerator=CPU,
                              label_pad_token_id=-100, **fields)
    for name in ("concatenated_forward", "cpo_loss", "odds_ratio_loss"):
        if hasattr(trainer_class, name):
            setattr(trainer, name, MethodType(getattr(trainer_class, name), trainer))
    trainer.concatenated_inputs = trainer_class.concatenated_inputs
    trainer.get_batch_logps = trainer_class.get_batch_logps
    return trainer


def trl_pair_batch(data, pad_id: int, pairs: list[int]) -> dict:
    """CPO / ORPO's batch: chosen and rejected rows apart, labels -100 on the prompt."""
    batch = {}
    for side, which in (("chosen", 0), ("rejected", 1)):
        rows = [data[i][which] for i in pairs]
        length = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), length), pad_id)
        labels = torch.full((len(rows), length), -100)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for r, (row_ids, row_labels) in enumerate(rows):
            ids[r, :len(row_ids)] = torch.tensor(row_ids.tolist())
            labels[r, :len(row_ids)] = torch.tensor(row_labels.tolist())
            mask[r, :len(row_ids)] = 1
        batch.update({f"{side}_input_ids": ids, f"{side}_labels": labels, f"{side}_attention_mask": mask})
    return batch


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_simpo_and_orpo_equal_trls_cpo_and_orpo_trainers(pairs, tiny_model_dir, loss_type):
    """simpo: CPOTrainer with loss_type simpo and cpo_alpha 0; orpo: ORPOTrainer's forward and odds ratio."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    data, tokenizer = pairs
    mine = load_model(tiny_model_dir, torch.float32)
    theirs = copy.deepcopy(mine)
    beta = 2.0 if loss_type == "simpo" else 0.1
    settings = PreferenceSettings(loss_type, beta)
    objective = PairLoss(mine, CPU_ENV, tokenizer.pad_token_id, settings, None)
    if loss_type == "simpo":
        trainer = cpo_like(CPOTrainer, theirs, loss_type="simpo", beta=beta, simpo_gamma=settings.simpo_gamma,
                           label_smoothing=0.0, cpo_alpha=0.0, alpha=0.0)
        trainer.pad_token_id = tokenizer.pad_token_id
        want, logged = CPOTrainer.get_batch_loss_metrics(trainer, theirs, trl_pair_batch(data, tokenizer.pad_token_id,
                                                                                         list(range(len(data)))))
        got, reported, _ = meshtune_loss(objective, data)
        for name in METRICS[:4]:  # CPO logs the mean log-probs under logps/*, meshtune (as TRL's DPO) the sums
            assert reported[name] == pytest.approx(logged[name], rel=1e-5, abs=1e-5), name
        compare(mine, theirs, got, want)
        return
    trainer = cpo_like(ORPOTrainer, theirs, beta=beta, padding_value=tokenizer.pad_token_id)
    # TRL's forward and odds ratio; its NLL term covers the prompt too, LLaMA-Factory's (meshtune's) the chosen
    # response only: its mean token log-prob, which TRL's forward returns
    chosen, rejected, *_ = trainer.concatenated_forward(theirs, trl_pair_batch(data, tokenizer.pad_token_id,
                                                                               list(range(len(data)))))
    ratio, chosen_rewards, rejected_rewards, _, _ = trainer.odds_ratio_loss(chosen, rejected)
    want = (-chosen - ratio).mean()
    got, reported, _ = meshtune_loss(objective, data)
    assert reported["rewards/chosen"] == pytest.approx(chosen_rewards.mean().item(), rel=1e-5)
    assert reported["rewards/rejected"] == pytest.approx(rejected_rewards.mean().item(), rel=1e-5)
    compare(mine, theirs, got, want)
