"""The host's share of one optimizer step for the parameters of a bench model shape.

Each parameter of the shape is built with every dimension divided by --divide (the same count and structure of
tensors, little memory), so the time measured is what the host spends launching the step rather than the memory
traffic of the update. Optimizers:

  torch-fused     torch's fused AdamW on fp32 weights (master_weights: fp32 on CUDA: one multi-tensor kernel)
  torch-foreach   torch's foreach AdamW on fp32 weights (master_weights: fp32 elsewhere)
  torchao-bf16    torchao's AdamW on bf16 weights with stochastic rounding (master_weights: bf16): one compiled call
                  for each parameter
  grouped-bf16    torchao's update, compiled once for each group of parameters of one shape and called once a group
                  (an alternative measured against torchao-bf16; not used by meshtune: see docs/benchmarks.md)
  meshtune-bf16   meshtune's StochasticBf16AdamW (master_weights: bf16): on CUDA one Triton kernel for every
                  parameter, elsewhere its reference, operator by operator

  python3 bench/optimizer_step_cost.py --size 1.5b --divide 24 --device cpu --optimizers torchao-bf16,torch-foreach

Prints one JSON line per optimizer: the first step (with any compilation) and the mean of --steps later steps.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from workspace import model_config

OPTIMIZERS = ["torch-fused", "torch-foreach", "torchao-bf16", "grouped-bf16", "meshtune-bf16"]


def parameter_shapes(size: str, divide: int) -> list[tuple[int, ...]]:
    """The shapes of the trainable parameters of a bench model (full fine-tuning), each dimension divided."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(model_config(size))
    return [tuple(max(1, d // divide) for d in p.shape) for p in model.parameters()]


def grouped_bf16_adamw(groups: list[dict], lr: float):
    """torchao's AdamW whose step calls torchao's own update once for each group of same-shaped parameters."""
    from torchao.optim import _AdamW
    from torchao.optim.adam import single_param_adam

    def update(ps, grads, steps, avgs, squares, lr, beta1, beta2, weight_decay, eps):
        for p, g, s, m, v in zip(ps, grads, steps, avgs, squares):
            single_param_adam(p, g, s, m, v, None, lr, beta1, beta2, weight_decay, eps, True, True)

    compiled = torch.compile(update, fullgraph=True, dynamic=False)

    class Grouped(_AdamW):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                by_shape = defaultdict(list)
                for p in group["params"]:
                    state = self.state[p]
                    if not state:
                        state.update(step=torch.tensor(0.0), exp_avg=self._new_buffer(p, True),
                                     exp_avg_sq=self._new_buffer(p, False))
                    state["step"] += 1
                    by_shape[p.shape].append(p)
                for ps in by_shape.values():
                    states = [self.state[p] for p in ps]
                    compiled([p.detach() for p in ps], [p.grad for p in ps], [s["step"] for s in states],
                             [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], group["lr"],
                             *group["betas"], group["weight_decay"], group["eps"])

    return Grouped(groups, lr=lr, bf16_stochastic_round=True)


def build(name: str, shapes: list[tuple[int, ...]], device: str) -> torch.optim.Optimizer:
    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    # as meshtune groups them: no weight decay on 1-D tensors
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    if name == "torch-fused":
        return torch.optim.AdamW(groups, lr=3e-4, fused=True)
    if name == "torch-foreach":
        return torch.optim.AdamW(groups, lr=3e-4, foreach=True)
    if name == "torchao-bf16":
        from torchao.optim import _AdamW

        return _AdamW(groups, lr=3e-4, bf16_stochastic_round=True)
    if name == "meshtune-bf16":
        from meshtune.train.bf16_adamw import StochasticBf16AdamW

        return StochasticBf16AdamW(groups, lr=3e-4)
    return grouped_bf16_adamw(groups, 3e-4)


def timed(step, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.5b", help="a bench model shape (bench/workspace.py SIZES)")
    p.add_argument("--divide", type=int, default=24, help="each dimension of each parameter divided by this")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--optimizers", default="torch-fused,torchao-bf16,meshtune-bf16", help=", ".join(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    shapes = parameter_shapes(args.size, args.divide)
    for name in args.optimizers.split(","):
        if name not in OPTIMIZERS:
            raise SystemExit(f"--optimizers: unknown {name!r}; choose from {', '.join(OPTIMIZERS)}")
        optimizer = build(name, shapes, args.device)
        first = timed(optimizer.step, args.device)
        timed(optimizer.step, args.device)
        later = sum(timed(optimizer.step, args.device) for _ in range(args.steps)) / args.steps
        print(json.dumps(dict(optimizer=name, size=args.size, divide=args.divide, device=args.device,
                              parameters=len(shapes), elements=sum(torch.Size(s).numel() for s in shapes),
                              first_step_s=round(first, 2), step_ms=round(later * 1e3, 2),
                              per_parameter_us=round(later / len(shapes) * 1e6, 1))), flush=True)


if __name__ == "__main__":
    main()
