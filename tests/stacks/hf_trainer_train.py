# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A tiny causal language model trained with the transformers ``Trainer`` and a DeepSpeed config, as an HF user
writes it: ZeRO-2 with the optimizer offloaded to the CPU, bf16, gradient accumulation 2, 4 optimizer steps.

    torchrun --nproc_per_node 2 hf_trainer_train.py [--import-patch] [--output-dir DIR]
    deepspeed --num_gpus 2 hf_trainer_train.py [--import-patch] [--output-dir DIR]

The model is built from a config (2 layers, hidden size 16, vocabulary 64), the data is synthetic. ``--import-patch``
imports deepspeed_offload_patch first, the way a user applies it; without it the script knows nothing of it.
"""

import argparse
import sys
import tempfile

parser = argparse.ArgumentParser()
parser.add_argument("--import-patch", action="store_true")
parser.add_argument("--output-dir", default=None)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
args = parser.parse_args()

if args.import_patch:
    import deepspeed_offload_patch  # noqa: F401

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, set_seed

SEED = 0
MICRO_BATCH, ACCUMULATION, SEQUENCE = 2, 2, 8

DEEPSPEED_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "weight_decay": "auto",
            "torch_adam": True  # torch's AdamW on the CPU: no C++ build of DeepSpeed's CPU Adam
        }
    },
    "bf16": {
        "enabled": "auto",
        "check_grad_overflow": True
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu"
        }
    },
    "zero_force_ds_cpu_optimizer": False,
}


class SyntheticTokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every rank and in every run."""

    def __init__(self, size: int, vocab: int):
        generator = torch.Generator().manual_seed(SEED)
        self.tokens = torch.randint(0, vocab, (size, SEQUENCE), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main() -> None:
    set_seed(SEED)
    config = LlamaConfig(vocab_size=64,
                         hidden_size=16,
                         intermediate_size=32,
                         num_hidden_layers=2,
                         num_attention_heads=2,
                         num_key_value_heads=2,
                         max_position_embeddings=SEQUENCE)
    # use_cpu: without a GPU, TrainingArguments refuses bf16 otherwise; the Trainer still builds DeepSpeed's engine.
    training_args = TrainingArguments(output_dir=args.output_dir or tempfile.mkdtemp(prefix="hf-trainer-"),
                                      deepspeed=DEEPSPEED_CONFIG,
                                      per_device_train_batch_size=MICRO_BATCH,
                                      gradient_accumulation_steps=ACCUMULATION,
                                      max_steps=args.steps,
                                      learning_rate=1e-2,
                                      bf16=True,
                                      use_cpu=True,
                                      seed=SEED,
                                      logging_steps=1,
                                      save_strategy="no",
                                      report_to="none",
                                      dataloader_num_workers=0,
                                      disable_tqdm=True)
    model = LlamaForCausalLM(config)
    dataset = SyntheticTokens(size=MICRO_BATCH * ACCUMULATION * args.steps * 2, vocab=config.vocab_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    result = trainer.train()
    print(f"rank {training_args.process_index}: {result.global_step} steps, loss {result.training_loss:.6f}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
