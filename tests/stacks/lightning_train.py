# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A small regression model trained with PyTorch Lightning's DeepSpeed strategy, as a Lightning user writes it:
ZeRO-2 with the optimizer offloaded to the CPU, bf16, gradient accumulation 2, 4 optimizer steps, 2 processes.

    python lightning_train.py [--import-patch]

Lightning starts the second process itself (it runs this script again with its rank in the environment). The model
is built from a config dict (4 Linear layers of width 16), the data is synthetic, the optimizer torch's AdamW (the
config sets ``zero_force_ds_cpu_optimizer`` false, so DeepSpeed keeps it rather than building its CPU Adam).
``--import-patch`` imports deepspeed_offload_patch first, the way a user applies it; without it the script knows
nothing of it.
"""

import argparse
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--import-patch", action="store_true")
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

if args.import_patch:
    import deepspeed_offload_patch  # noqa: F401

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

SEED = 0
MODEL_CONFIG = {"width": 16, "layers": 4}
MICRO_BATCH, ACCUMULATION = 2, 2
# One CPU device per process, numbered: the strategy checks that process N's device has index N (a GPU's), and a
# plain "cpu" device has none; torch treats every "cpu:N" as the CPU. Configuration, not a lifted check.
CPU_DEVICES = [torch.device("cpu", index) for index in range(2)]
DEEPSPEED_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "bf16": {
        "enabled": True,
        "check_grad_overflow": True
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu"
        }
    },
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
}


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy with one check lifted: its ``setup_environment`` refuses any accelerator but
    CUDA, although DeepSpeed runs on the CPU through its own CPU accelerator. Everything after that check (the DDP
    environment setup) and everything else is Lightning's and DeepSpeed's own."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)


class Regression(pl.LightningModule):

    def __init__(self, config: dict):
        super().__init__()
        self.save_hyperparameters()
        width = config["width"]
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(config["layers"])])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    pl.seed_everything(SEED, workers=True)
    width = MODEL_CONFIG["width"]
    samples = MICRO_BATCH * ACCUMULATION * args.steps * 2
    generator = torch.Generator().manual_seed(SEED)
    data = torch.utils.data.TensorDataset(torch.randn(samples, width, generator=generator),
                                          torch.randn(samples, width, generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO_BATCH)
    trainer = pl.Trainer(accelerator="cpu",
                         devices=2,
                         strategy=CPUDeepSpeedStrategy(stage=2,
                                                       offload_optimizer=True,
                                                       config=DEEPSPEED_CONFIG,
                                                       parallel_devices=CPU_DEVICES),
                         precision="bf16-mixed",
                         max_steps=args.steps,
                         accumulate_grad_batches=ACCUMULATION,
                         logger=False,
                         enable_checkpointing=False,
                         enable_progress_bar=False,
                         enable_model_summary=False)
    model = Regression(MODEL_CONFIG)
    trainer.fit(model, loader)
    print(f"rank {trainer.global_rank}: {trainer.global_step} steps", file=sys.stderr)


if __name__ == "__main__":
    main()
