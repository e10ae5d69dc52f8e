# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""Write the DeepSpeed configs that HF Trainer and Accelerate generate for a ZeRO-2 optimizer-offload job, as they
hand them to ``deepspeed.initialize``, into ``tests/unit/configs/`` (the fixtures of ``tests/unit/test_affected.py``).

* ``hf_trainer_generated_zero2_offload.json``: ``hf_trainer_zero2_offload.json`` (the ZeRO-2 offload file in the
  shape HF's DeepSpeed guide gives, its values ``"auto"``) through ``TrainingArguments(deepspeed=..., bf16=True,
  per_device_train_batch_size=2, gradient_accumulation_steps=2)`` and the Trainer's final fill-in for a tiny Llama.
* ``accelerate_generated_zero2_offload.json``: what ``Accelerator()`` builds from the environment that
  ``accelerate launch --use_deepspeed --zero_stage 2 --offload_optimizer_device cpu --mixed_precision bf16
  --gradient_accumulation_steps 2`` gives it (no config file: Accelerate writes the config itself).

Needs transformers and accelerate (the stacks session installs them). Each library runs in a process of its own,
one rank, on the CPU. ``--check`` writes nothing and exits 1 when a committed file differs from what the installed
libraries generate (``tests/stacks/test_stacks.py`` runs it); ``generated-with.json`` records the versions.

    python ci/gen_configs.py [--check]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "tests", "unit", "configs")
HF_TEMPLATE = os.path.join(CONFIGS, "hf_trainer_zero2_offload.json")
VERSIONS = "generated-with.json"
ONE_RANK = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
# What `accelerate launch` exports for the flags in the docstring (accelerate/commands/launch.py).
ACCELERATE_LAUNCH = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
    "ACCELERATE_MIXED_PRECISION": "bf16",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
}

HF_TRAINER = """
import json, sys
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
with open(sys.argv[1]) as f:
    template = json.load(f)
args = TrainingArguments(output_dir=sys.argv[3], deepspeed=template, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, bf16=True, use_cpu=True, learning_rate=1e-2, report_to="none")
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2))
args.hf_deepspeed_config.trainer_config_finalize(args, model, 10)
with open(sys.argv[2], "w") as f:
    json.dump(args.hf_deepspeed_config.config, f, indent=2)
"""

ACCELERATE = """
import json, sys
from accelerate import Accelerator
with open(sys.argv[1], "w") as f:
    json.dump(Accelerator().state.deepspeed_plugin.deepspeed_config, f, indent=2)
"""


def _run(code: str, args, env: Dict[str, str]) -> None:
    from deepspeed_offload_patch import cpu_shm
    from deepspeed_offload_patch.testing.launch import free_port

    full = dict(os.environ, **ONE_RANK, MASTER_PORT=str(free_port()), **env)
    # Both libraries initialize deepspeed.comm on this one rank: on the CPU, DeepSpeed's shm op then leaves its
    # buffer file in /dev/shm (0.19.6 does; a stacks test saw it).
    with cpu_shm.removes_leftovers():
        done = subprocess.run([sys.executable, "-c", code] + list(args), env=full, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"generating a config failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def generate(folder: str) -> Dict[str, str]:
    """Write both generated configs and ``generated-with.json`` into ``folder``; return {file name: text}."""
    import importlib.metadata

    with tempfile.TemporaryDirectory() as scratch:
        _run(HF_TRAINER, [HF_TEMPLATE, os.path.join(folder, "hf_trainer_generated_zero2_offload.json"), scratch], {})
        _run(ACCELERATE, [os.path.join(folder, "accelerate_generated_zero2_offload.json")], ACCELERATE_LAUNCH)
    versions = {name: importlib.metadata.version(name) for name in ("transformers", "accelerate")}
    with open(os.path.join(folder, VERSIONS), "w") as f:
        json.dump(versions, f, indent=2)
    found = {}
    for name in ("hf_trainer_generated_zero2_offload.json", "accelerate_generated_zero2_offload.json", VERSIONS):
        with open(os.path.join(folder, name)) as f:
            found[name] = f.read()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed files; write nothing")
    args = parser.parse_args()
    if not args.check:
        for name in generate(CONFIGS):
            print(f"wrote tests/unit/configs/{name}")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        fresh = generate(scratch)
    stale = []
    for name, text in fresh.items():
        path = os.path.join(CONFIGS, name)
        if not os.path.exists(path) or open(path).read() != text:
            stale.append(name)
    for name in stale:
        print(f"tests/unit/configs/{name} is not what the installed libraries generate: run python ci/gen_configs.py")
    if not stale:
        print("the committed configs are what the installed transformers and accelerate generate")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
