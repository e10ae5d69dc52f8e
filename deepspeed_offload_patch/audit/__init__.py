# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""``ds-offload-patch audit``: host syncs per training phase in every rank of a user's own run, with budgets.

Three modules, whose imports run one way (command, then rank, then report):

* :mod:`~deepspeed_offload_patch.audit.command`: the command: launches the run as ``run`` does (once, or twice with
  ``--compare``), reads the ranks' reports, checks the budgets, sets the exit code.
* :mod:`~deepspeed_offload_patch.audit.rank`: what runs inside each rank (installed by the bootstrap
  ``sitecustomize``): wraps the engine's forward, backward and step and counts host syncs per phase.
* :mod:`~deepspeed_offload_patch.audit.report`: the numbers as people read them (tables, top lines, budgets); no
  torch, no DeepSpeed.
"""


def __getattr__(name: str):
    # ``audit`` (the command's entry point) without importing the launcher into every rank that imports the package.
    if name == "audit":
        from deepspeed_offload_patch.audit.command import audit
        return audit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
