# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""A tiny causal language model trained in a plain Accelerate loop, as an Accelerate user writes it; DeepSpeed comes
from the launch command (ZeRO-2 with the optimizer offloaded to the CPU, bf16, gradient accumulation 2):

    accelerate launch --num_processes 2 --use_deepspeed --deepspeed_config_file accelerate_ds_config.json \\
        accelerate_train.py [--import-patch]

The model is built from a config (2 layers, hidden size 16, vocabulary 64), the data is synthetic, the optimizer is
torch's AdamW (the config sets ``zero_force_ds_cpu_optimizer`` false, so DeepSpeed keeps it rather than building its
CPU Adam). On a machine without an accelerator, Accelerate finds no distributed backend of its own and counts one
process, while DeepSpeed trains on both ranks (gloo): each rank then reads every batch. ``--import-patch`` imports deepspeed_offload_patch first, the way a user applies it; without it the script
knows nothing of it.
"""

import argparse
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--import-patch", action="store_true")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--grad-accum", type=int, default=2, help="as the DeepSpeed config's (default 2)")
parser.add_argument("--save", help="write the parameters after the last step here (rank 0)")
args = parser.parse_args()

if args.import_patch:
    import deepspeed_offload_patch  # noqa: F401

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 0
MICRO_BATCH, SEQUENCE = 2, 8


def main() -> None:
    # The same accumulation as the DeepSpeed config (DeepSpeed's value wins; naming it here keeps Accelerate quiet).
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    set_seed(SEED)
    config = LlamaConfig(vocab_size=64,
                         hidden_size=16,
                         intermediate_size=32,
                         num_hidden_layers=2,
                         num_attention_heads=2,
                         num_key_value_heads=2,
                         max_position_embeddings=SEQUENCE)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accumulation = accelerator.gradient_accumulation_steps
    samples = MICRO_BATCH * accumulation * args.steps * accelerator.num_processes
    tokens = torch.randint(0, config.vocab_size, (samples, SEQUENCE), generator=torch.Generator().manual_seed(SEED))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=MICRO_BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    model.train()
    for (batch, ) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                # DeepSpeed clips by its config's gradient_clipping (this call leaves it to it); a run without
                # DeepSpeed clips here, by the same 1.0.
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    rank = getattr(model, "global_rank", 0)
    print(f"rank {rank}: {getattr(model, 'global_steps', args.steps)} steps, last loss {loss.item():.6f}",
          file=sys.stderr)
    if args.save and rank == 0:
        inner = getattr(model, "module", model)
        torch.save({name: p.detach().float().cpu() for name, p in inner.named_parameters()}, args.save)
    accelerator.end_training()


if __name__ == "__main__":
    main()
