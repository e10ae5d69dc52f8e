# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A small model and ZeRO-1/2 offload engines for the demo, the tests and the benchmark, runnable on a CPU."""

from typing import Any, Dict, Iterable, Optional, Union

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


class SometimesUnused(ManyLinear):
    """:class:`ManyLinear` plus a side layer that only some forward passes use (``use_side``): its parameters get no
    gradient in the others, and one more layer never gets one."""

    def __init__(self, num_tensors: int = 120, hidden: int = 8):
        super().__init__(num_tensors, hidden)
        self.side = torch.nn.Linear(hidden, hidden)
        self.never_used = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        if use_side:
            x = x + torch.tanh(self.side(x))
        return super().forward(x)


def param_groups(model: torch.nn.Module) -> list:
    """Two optimizer param groups with different learning rates and weight decay: the first half of the model's
    parameters, and the rest."""
    params = list(model.parameters())
    half = len(params) // 2
    return [{"params": params[:half]}, {"params": params[half:], "lr": 5e-3, "weight_decay": 0.01}]


def ds_config(stage: int = 2,
              dtype: str = "bf16",
              check_grad_overflow: bool = True,
              grad_accum: int = 1,
              micro_batch: int = 2,
              initial_scale_power: int = 8,
              **zero_options: Any) -> Dict[str, Any]:
    """A DeepSpeed config for ZeRO ``stage`` (1 or 2) with the optimizer offloaded to the CPU and torch's Adam.

    ``dtype`` is ``"bf16"``, ``"fp16"`` or ``"fp32"``; ``check_grad_overflow`` applies to bf16 (fp16 always checks,
    fp32 never). fp16 uses dynamic loss scaling from ``2**initial_scale_power`` (a large power overflows in the
    first steps on every rank, as fp16 runs do); on the CPU it needs :func:`~deepspeed_offload_patch.testing.
    allow_fp16_on_cpu`, which :func:`make_engine` calls. ``zero_options`` go into ``zero_optimization``
    (``overlap_comm``, ``contiguous_gradients``, ...).
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
        # torch's Adam under ZeRO: releases before 0.19 call it untested in fp32 unless allowed.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True, "check_grad_overflow": check_grad_overflow}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": initial_scale_power, "hysteresis": 1}
    elif dtype != "fp32":
        raise ValueError(f"dtype must be 'bf16', 'fp16' or 'fp32', not {dtype!r}")
    return config


def make_engine(num_tensors: int = 120,
                hidden: int = 8,
                seed: int = 1234,
                config: Optional[Dict[str, Any]] = None,
                model_class: type = ManyLinear,
                groups: bool = False):
    """A DeepSpeed engine over ``model_class`` (:class:`ManyLinear` or :class:`SometimesUnused`), with the same
    initial parameters on every rank; with ``groups``, over the two :func:`param_groups`.

    ``deepspeed.comm`` must be initialized (see :mod:`deepspeed_offload_patch.testing.launch`).
    """
    import deepspeed

    from deepspeed_offload_patch.testing import allow_fp16_on_cpu

    config = config if config is not None else ds_config()
    if config.get("fp16", {}).get("enabled"):
        allow_fp16_on_cpu()
    torch.manual_seed(seed)
    model = model_class(num_tensors, hidden)
    parameters: Union[Iterable, list] = param_groups(model) if groups else model.parameters()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=parameters, config=config)
    return engine


def batch(engine, step: int, hidden: int = 8) -> torch.Tensor:
    """A deterministic input batch for ``step`` on this rank, on the engine's device and dtype."""
    generator = torch.Generator().manual_seed(1000 * step + engine.global_rank)
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), hidden, generator=generator)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32
    return x.to(device=engine.device, dtype=dtype)


def optimizer_step(engine) -> None:
    """``engine.step()`` without autograd recording, as ``torch.optim`` optimizers step.

    DeepSpeed 0.18.7-0.18.9 build the flat parameter buffer of ZeRO-1/2 inside the autograd graph (0.19.0 detaches
    it); in grad mode, gloo's all-gather into that buffer's partitions then fails ("Output 0 of Split is a view and
    is being modified inplace"), patched or not. Stepping under ``no_grad`` changes nothing else on any release.
    """
    with torch.no_grad():
        engine.step()


def params_snapshot(engine) -> Dict[str, torch.Tensor]:
    """A CPU copy of the model's (low-precision) parameters, by name."""
    return {name: p.detach().float().cpu().clone() for name, p in engine.module.named_parameters()}
