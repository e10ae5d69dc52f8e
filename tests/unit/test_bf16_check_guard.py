# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The bf16-check default's guard and its lifecycle.

On synthetic pydantic models shaped like DeepSpeed's ``DeepSpeedBF16Config``: it applies where the field defaults to
false, with class attributes that carry the new default and leave the class as it was until they are installed; a
release that shipped false and defaults to true (``patches/`` applied) is ``upstream-fixed``, a later one
``not-needed``, as is a class without the field; a default that is neither is a ``conflict``; a class that is no
pydantic model, a rebuild that fails and a refused release are ``unsupported``. Then on the installed DeepSpeed, with
its default set back to false the way 0.17.1 - 0.19.2 ship it: applied at import, idempotent, exactly reverted,
switched off by its switch and by the upstream-only one, a conflict when someone else replaces the validator after
it, and strict mode's error when it cannot apply.
"""

from typing import Optional

import pytest
from pydantic import BaseModel

from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.changes.bf16_check import default
from deepspeed_offload_patch.states import State
from unit.common import assert_ok, run_python

CHANGE = by_name("bf16-check")


def _model(value, field: bool = True) -> type:
    """A pydantic model with DeepSpeed's bf16 fields, ``check_grad_overflow`` defaulting to ``value``."""
    namespace = {"__annotations__": {"enabled": bool}, "enabled": False}
    if field:
        namespace["__annotations__"]["check_grad_overflow"] = Optional[bool] if value is None else bool
        namespace["check_grad_overflow"] = value
    return type("DeepSpeedBF16Config", (BaseModel, ), namespace)


def _decide(cls: type, version: str = "0.18.9"):
    return CHANGE.decide(CHANGE, cls, version)


def test_a_false_default_is_applied_with_attributes_that_leave_the_class_as_it_was():
    cls = _model(False)
    before = dict(cls.__dict__)
    decision = _decide(cls)
    assert decision.state == State.APPLIED and "defaults to false" in decision.reason, decision
    assert "__pydantic_validator__" in decision.replacements and "__pydantic_fields__" in decision.replacements
    assert dict(cls.__dict__) == before and cls().check_grad_overflow is False  # decide changed nothing
    for name, attribute in decision.replacements.items():
        setattr(cls, name, attribute)
    assert cls().check_grad_overflow is True and cls(check_grad_overflow=False).check_grad_overflow is False
    assert _decide(cls).state == State.APPLIED and "already applied" in _decide(cls).reason
    for name in decision.replacements:
        setattr(cls, name, before[name])
    assert cls().check_grad_overflow is False and all(cls.__dict__[name] is before[name] for name in before)


@pytest.mark.parametrize("version, state", [("0.17.1", State.UPSTREAM_FIXED), ("0.19.2", State.UPSTREAM_FIXED),
                                            ("0.19.3", State.NOT_NEEDED), ("0.19.8", State.NOT_NEEDED)])
def test_a_true_default_is_upstream_fixed_where_the_release_shipped_false(version, state):
    assert _decide(_model(True), version).state == state


def test_no_field_is_not_needed_and_a_foreign_default_is_a_conflict():
    assert _decide(_model(False, field=False)).state == State.NOT_NEEDED
    decision = _decide(_model(None))
    assert decision.state == State.CONFLICT and "None" in decision.reason, decision


def test_what_it_cannot_change_is_unsupported_and_left_as_it_is(monkeypatch):

    class NotPydantic:
        check_grad_overflow = False

    assert _decide(NotPydantic).state == State.UNSUPPORTED
    assert _decide(_model(False), "0.13.5").state == State.UNSUPPORTED
    cls = _model(False)
    before = dict(cls.__dict__)

    def broken(*args, **kwargs):
        raise RuntimeError("a pydantic that builds models otherwise")

    monkeypatch.setattr(cls, "model_rebuild", broken)
    before["model_rebuild"] = cls.__dict__["model_rebuild"]
    decision = _decide(cls)
    assert decision.state == State.UNSUPPORTED and "otherwise" in decision.reason and not decision.replacements
    assert dict(cls.__dict__) == before and cls().check_grad_overflow is False


def test_a_rebuild_that_does_not_give_the_default_is_refused(monkeypatch):
    cls = _model(False)
    monkeypatch.setattr(cls, "model_rebuild", lambda **kwargs: None)  # a pydantic whose validator keeps its default
    before = dict(cls.__dict__)
    with pytest.raises(RuntimeError, match="does not default"):
        default.with_default(cls, "check_grad_overflow", True)
    assert dict(cls.__dict__) == before and cls().check_grad_overflow is False


def test_a_release_without_the_config_module_is_told_without_importing_deepspeed():
    """Before 0.17.x DeepSpeed has no ``deepspeed.runtime.precision_config``: the change is then ``not-needed``, which
    the patcher finds from DeepSpeed's package folder (importing DeepSpeed at the package's import is not allowed)."""
    from deepspeed_offload_patch.patch_status import deepspeed_lacks

    assert CHANGE.target.optional
    assert deepspeed_lacks("deepspeed.runtime.no_such_module") and not deepspeed_lacks("deepspeed.runtime.config")
    assert_ok(
        run_python("""
import sys
import deepspeed_offload_patch as dop
from deepspeed_offload_patch.changes import by_name
from deepspeed_offload_patch.changes.bf16_check import BF16_CONFIG
object.__setattr__(BF16_CONFIG, "module", "deepspeed.runtime.no_such_module")  # a release without it
dop.revert(); dop.patcher._pend_other_targets()
state, reason = dop.status().of(by_name("bf16-check"))
assert state == "not-needed" and "no_such_module" in reason, reason
assert "deepspeed" not in sys.modules
"""))


# Before the package's import: DeepSpeed's bf16 config defaulting to false, as 0.17.1 - 0.19.2 ship it.
AS_0_17 = """
from deepspeed.runtime.precision_config import DeepSpeedBF16Config as cls
cls.__pydantic_fields__["check_grad_overflow"].default = False
cls.model_rebuild(force=True)
own = dict(cls.__dict__)
"""


def test_on_a_release_that_defaults_to_false_it_applies_once_and_reverts_exactly():
    assert_ok(
        run_python(AS_0_17 + """
import deepspeed_offload_patch as dop
from deepspeed_offload_patch.changes import by_name
change = by_name("bf16-check")
assert dop.status().of(change)[0] == "applied", dop.status()
assert cls(enabled=True).check_grad_overflow is True
assert cls(enabled=True, check_grad_overflow=False).check_grad_overflow is False
assert cls(enabled="auto", check_grad_overflow="auto").check_grad_overflow is True  # HF's "auto": as left out
installed = dict(cls.__dict__)
assert dop.apply().of(change)[0] == "applied" and dict(cls.__dict__) == installed
assert dop.revert().of(change)[0] == "reverted"
assert dict(cls.__dict__) == own and cls().check_grad_overflow is False
assert dop.apply().of(change)[0] == "applied" and cls().check_grad_overflow is True
cls.__pydantic_validator__ = own["__pydantic_validator__"]  # someone else's rebuild
assert dop.status().of(change)[0] == "conflict", dop.status()
"""))


@pytest.mark.parametrize("switch", ["DS_OFFLOAD_PATCH_BF16_CHECK", "DS_OFFLOAD_PATCH_UPSTREAM_ONLY"])
def test_its_switch_and_the_upstream_only_switch_leave_it_out(switch):
    value = "0" if switch.endswith("BF16_CHECK") else "1"
    assert_ok(
        run_python(AS_0_17 + """
import deepspeed_offload_patch as dop
from deepspeed_offload_patch.changes import by_name
assert dop.status().of(by_name("bf16-check"))[0] == "off", dop.status()
assert dict(cls.__dict__) == own and cls().check_grad_overflow is False
""",
                   env={switch: value}))


@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_default_it_cannot_set_warns_once_or_fails_in_strict_mode(strict):
    result = run_python(AS_0_17 + """
import deepspeed_offload_patch as dop
import deepspeed_offload_patch.changes.bf16_check.default as default
from deepspeed_offload_patch.changes import by_name
def broken(*args, **kwargs):
    raise RuntimeError("no rebuild here")
default.with_default = broken
assert dop.apply().of(by_name("bf16-check"))[0] == "unsupported", dop.status()
assert dict(cls.__dict__) == own and cls().check_grad_overflow is False
""",
                        env={
                            "DS_OFFLOAD_PATCH_AUTO": "0",
                            "DS_OFFLOAD_PATCH_STRICT": strict
                        })
    text = result.stdout + result.stderr
    if strict == "1":
        assert result.returncode != 0 and "PatchError" in text and "no rebuild here" in text, text
    else:
        assert_ok(result)
        lines = [line for line in text.splitlines() if "bf16-check default not applied" in line]
        assert len(lines) == 1 and "WARNING" in lines[0], text
