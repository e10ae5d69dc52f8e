# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Small models and ZeRO-1/2 offload engines for the demo, the tests and the benchmark, runnable on a CPU: a chain of
Linear layers, one with a mixture-of-experts layer, and Megatron-shaped model-parallel groups (:class:`ModelParallelGroups`)."""

from typing import Any, Dict, Iterable, List, Optional, Union

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


class WithExperts(ManyLinear):
    """:class:`ManyLinear` followed by DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``): 2 experts
    (Linear layers), expert parallelism 2, top-1 gating. Its expert parameters reach ZeRO through the expert
    data-parallel groups; the gate's are dense. The gate's auxiliary loss is added to the output's. ``deepspeed.comm``
    must be initialized, on a world that 2 divides."""

    def __init__(self, num_tensors: int = 120, hidden: int = 8):
        from deepspeed.moe.layer import MoE

        super().__init__(num_tensors, hidden)
        # min_capacity=0: tiny batches have fewer tokens than the default minimum capacity, which MoE asserts.
        self.moe = MoE(hidden_size=hidden,
                       expert=torch.nn.Linear(hidden, hidden),
                       num_experts=2,
                       ep_size=2,
                       k=1,
                       min_capacity=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        x, aux_loss, _ = self.moe(x)
        return x.float().pow(2).mean() + aux_loss.float()


class ModelParallelGroups:
    """The process groups of Megatron's ``mpu``, for ``deepspeed.initialize(..., mpu=...)``: model-parallel groups of
    ``model_parallel_size`` adjacent ranks ([0, 1], [2, 3] for 2 of 4 ranks), data-parallel groups strided across them
    ([0, 2], [1, 3]). ZeRO partitions over the data-parallel group, and ``has_overflow()`` all-reduces the flag over the
    model-parallel group too.

    Every rank must build it, in the same order (each group is created on every rank). Raises ``ValueError`` when the
    world size is not a multiple of ``model_parallel_size``.
    """

    def __init__(self, model_parallel_size: int):
        from deepspeed import comm as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        if model_parallel_size < 1 or world % model_parallel_size:
            raise ValueError(f"{world} ranks do not split into model-parallel groups of {model_parallel_size}")
        self._rank = rank
        layouts = [list(range(start, start + model_parallel_size)) for start in range(0, world, model_parallel_size)]
        strided = [list(range(offset, world, model_parallel_size)) for offset in range(model_parallel_size)]
        self._model, self._model_ranks = self._mine(dist, layouts)
        self._data, self._data_ranks = self._mine(dist, strided)

    def _mine(self, dist, layouts: List[List[int]]):
        mine = None
        for ranks in layouts:
            group = dist.new_group(ranks)
            if self._rank in ranks:
                mine = (group, ranks)
        return mine

    def get_model_parallel_rank(self) -> int:
        return self._model_ranks.index(self._rank)

    def get_model_parallel_world_size(self) -> int:
        return len(self._model_ranks)

    def get_model_parallel_group(self):
        return self._model

    def get_data_parallel_rank(self) -> int:
        return self._data_ranks.index(self._rank)

    def get_data_parallel_world_size(self) -> int:
        return len(self._data_ranks)

    def get_data_parallel_group(self):
        return self._data

    def get_data_parallel_group_ranks(self) -> List[int]:
        return list(self._data_ranks)


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
              grad_accum_dtype: Optional[str] = None,
              **zero_options: Any) -> Dict[str, Any]:
    """A DeepSpeed config for ZeRO ``stage`` (1 or 2) with the optimizer offloaded to the CPU and torch's Adam.

    ``dtype`` is ``"bf16"``, ``"fp16"`` or ``"fp32"``; ``check_grad_overflow`` applies to bf16 (fp16 always checks,
    fp32 never). fp16 uses dynamic loss scaling from ``2**initial_scale_power`` (a large power overflows in the
    first steps on every rank, as fp16 runs do); on the CPU it needs :func:`~deepspeed_offload_patch.testing.
    allow_fp16_on_cpu`, which :func:`make_engine` calls. ``zero_options`` go into ``zero_optimization``
    (``overlap_comm``, ``contiguous_gradients``, ...). ``grad_accum_dtype`` (``"fp32"``) accumulates gradients in that
    dtype (``data_types``); at ZeRO-1 DeepSpeed then keeps them in a per-parameter attribute.
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
    if grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return config


def make_engine(num_tensors: int = 120,
                hidden: int = 8,
                seed: int = 1234,
                config: Optional[Dict[str, Any]] = None,
                model_class: type = ManyLinear,
                groups: bool = False,
                mpu: Optional[ModelParallelGroups] = None):
    """A DeepSpeed engine over ``model_class`` (:class:`ManyLinear`, :class:`SometimesUnused` or
    :class:`WithExperts`), with the same initial parameters on every rank; with ``groups``, over the two
    :func:`param_groups`. With :class:`WithExperts`, the parameters are split into dense and expert groups as DeepSpeed
    requires for MoE.

    With ``mpu``, each model-parallel rank holds its own part of the model, as tensor-parallel shards do: its own
    initial parameters (seeded by model-parallel rank), each marked ``model_parallel`` so that DeepSpeed's gradient
    norm counts it once per model-parallel group.

    ``deepspeed.comm`` must be initialized (see :mod:`deepspeed_offload_patch.testing.launch`).
    """
    import deepspeed

    from deepspeed_offload_patch.testing import allow_fp16_on_cpu

    config = config if config is not None else ds_config()
    if config.get("fp16", {}).get("enabled"):
        allow_fp16_on_cpu()
    torch.manual_seed(seed + (mpu.get_model_parallel_rank() if mpu is not None else 0))
    model = model_class(num_tensors, hidden)
    if mpu is not None:
        for param in model.parameters():
            param.model_parallel = True
    parameters: Union[Iterable, list] = param_groups(model) if groups else model.parameters()
    if model_class is WithExperts:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        dense = param_groups(model) if groups else [{"params": list(model.parameters()), "name": "dense"}]
        parameters = split_params_into_different_moe_groups_for_optimizer(dense)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=parameters, config=config, mpu=mpu)
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
