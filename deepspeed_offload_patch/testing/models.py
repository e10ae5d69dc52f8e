# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A small model and ZeRO-1/2 offload engines for the demo, the tests and the benchmark, runnable on a CPU."""

from typing import Any, Dict, Optional

import torch


class ManyLinear(torch.nn.Module):
    """``num_tensors // 2`` small Linear layers in a chain: many parameter tensors, little compute, so the cost per
    parameter tensor shows. Each layer has a weight and a bias."""

    def __init__(self, num_tensors: int = 120, hidden: int = 8):
        super().__init__()
        if num_tensors < 2 or num_tensors % 2:
            raise ValueError(f"num_tensors must be an even number >= 2, not {num_tensors}")
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(num_tensors // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.float().pow(2).mean()


def ds_config(stage: int = 2,
              dtype: str = "bf16",
              check_grad_overflow: bool = True,
              grad_accum: int = 1,
              micro_batch: int = 2,
              **zero_options: Any) -> Dict[str, Any]:
    """A DeepSpeed config for ZeRO ``stage`` (1 or 2) with the optimizer offloaded to the CPU and torch's Adam.

    ``dtype`` is ``"bf16"`` or ``"fp32"``; ``check_grad_overflow`` applies to bf16 (fp32 never checks).
    ``zero_options`` go into ``zero_optimization`` (``overlap_comm``, ``contiguous_gradients``, ...).
    """
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {
                "device": "cpu"
            },
            **zero_options
        },
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True, "check_grad_overflow": check_grad_overflow}
    elif dtype != "fp32":
        raise ValueError(f"dtype must be 'bf16' or 'fp32' on the CPU, not {dtype!r}")
    return config


def make_engine(num_tensors: int = 120, hidden: int = 8, seed: int = 1234, config: Optional[Dict[str, Any]] = None):
    """A DeepSpeed engine over :class:`ManyLinear`, with the same initial parameters on every rank.

    ``deepspeed.comm`` must be initialized (see :mod:`deepspeed_offload_patch.testing.launch`).
    """
    import deepspeed

    torch.manual_seed(seed)
    model = ManyLinear(num_tensors, hidden)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=config if config is not None else ds_config())
    return engine


def batch(engine, step: int, hidden: int = 8) -> torch.Tensor:
    """A deterministic input batch for ``step`` on this rank, on the engine's device and dtype."""
    generator = torch.Generator().manual_seed(1000 * step + engine.global_rank)
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), hidden, generator=generator)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    return x.to(device=engine.device, dtype=dtype)


def params_snapshot(engine) -> Dict[str, torch.Tensor]:
    """A CPU copy of the model's (low-precision) parameters, by name."""
    return {name: p.detach().float().cpu().clone() for name, p in engine.module.named_parameters()}
