# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The rank-agreement fix's guard, on synthetic ``DeepSpeedZeroOptimizer`` classes (module files written here, so their
source is real and readable): it applies where ``step()`` passes ``partition_gradients`` to the check and
``has_overflow`` all-reduces only when it is true (0.17.1 - 0.17.6's shape), and nowhere else; the package's own text
is ``upstream-fixed``; a ``_check_overflow`` replaced by someone else is a ``conflict``. ``_check_overflow``'s
defective text is the package's replacement with the fix taken out, which must be DeepSpeed's known form."""

import inspect
import textwrap

import pytest

from deepspeed_offload_patch import guard
from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.changes.rank_agreement import methods
from deepspeed_offload_patch.fingerprints import UNFIXED
from unit.common import synthetic_class

CHANGE = by_name("rank-agreement")
METHOD = "_check_overflow"
STEP_PASSING = """
def step(self, closure=None):
    self.check_overflow(partition_gradients=self.partition_gradients)
"""
STEP_DEFAULT = """
def step(self, closure=None):
    self.check_overflow()
"""
GATED = """
def has_overflow(self, partition_gradients=True):
    flag = self.local_flag()
    if partition_gradients:
        dist.all_reduce(flag, group=self.dp_process_group)
    return bool(flag)
"""
ALWAYS = """
def has_overflow(self, partition_gradients=True):
    flag = self.local_flag()
    dist.all_reduce(flag, group=self.dp_process_group)
    return bool(flag)
"""


def _check(fixed: bool) -> str:
    text = textwrap.dedent(inspect.getsource(methods._check_overflow))
    return text if fixed else text.replace("partition_gradients or self.cpu_offload", "partition_gradients")


def _class(tmp_path, name: str, *texts: str):
    return synthetic_class(tmp_path, name, "\n".join(texts))


def test_the_defective_text_is_deepspeeds_known_form(tmp_path):
    cls = _class(tmp_path, "known", _check(False), STEP_PASSING, GATED)
    assert "0.17.6" in UNFIXED[METHOD][guard.fingerprint(cls.__dict__[METHOD])]


@pytest.mark.parametrize("version", ["0.17.6", "0.20.0"])
def test_a_step_that_passes_the_stage_to_a_gated_all_reduce_gets_the_fix(tmp_path, version):
    cls = _class(tmp_path, f"gated_{version.replace('.', '_')}", _check(False), STEP_PASSING, GATED)
    decision = CHANGE.decide(CHANGE, cls, version)
    assert decision.state == "applied" and decision.replacements == {METHOD: methods._check_overflow}, decision
    assert "only when step() says the gradients are partitioned" in decision.reason, decision.reason
    assert ("newer than the releases tested" in decision.reason) == (version == "0.20.0"), decision.reason


@pytest.mark.parametrize("step, has_overflow", [(STEP_DEFAULT, GATED), (STEP_PASSING, ALWAYS)],
                         ids=["step-passes-nothing", "all-reduce-always"])
def test_where_the_ranks_agree_the_fix_is_not_needed(tmp_path, step, has_overflow):
    cls = _class(tmp_path, f"agree_{len(step)}_{len(has_overflow)}", _check(False), step, has_overflow)
    decision = CHANGE.decide(CHANGE, cls, "0.18.9")
    assert decision.state == "not-needed" and decision.replacements == {}, decision


def test_the_package_s_text_is_upstream_fixed_and_another_patch_is_a_conflict(tmp_path):
    cls = _class(tmp_path, "diffed", _check(True), STEP_PASSING, GATED)
    assert CHANGE.decide(CHANGE, cls, "0.17.6").state == "upstream-fixed"
    cls = _class(tmp_path, "foreign", _check(False), STEP_PASSING, GATED)
    cls._check_overflow = lambda self, partition_gradients=True: None
    assert CHANGE.decide(CHANGE, cls, "0.17.6").state == "conflict"


def test_an_older_release_is_unsupported(tmp_path):
    cls = _class(tmp_path, "older", _check(False), STEP_PASSING, GATED)
    assert CHANGE.decide(CHANGE, cls, "0.13.5").state == "unsupported"
