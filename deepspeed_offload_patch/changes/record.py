# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""What a change to DeepSpeed declares: the one record that the guard, the patcher, the CLI and CI read.

A :class:`Change` names the class it changes (its :class:`Target`: ZeRO-1/2's ``DeepSpeedZeroOptimizer`` unless it says
otherwise), the methods it replaces (one :class:`Form` per shape DeepSpeed gave them, each with its releases), how the
guard decides about it, its states and words, and where its diffs live.
Everything else in the package loops over :data:`deepspeed_offload_patch.changes.CHANGES`; ``docs/design.md`` says how
to add one.
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from deepspeed_offload_patch.settings import NAME_PREFIX
from deepspeed_offload_patch.states import State


@dataclass(frozen=True)
class Target:
    """The DeepSpeed class a change replaces methods (or sets a default) of: ``module`` (importable name), ``name``
    (the class) and the ZeRO ``stages`` it runs. ``optional``: releases without the module exist (older ones), and
    there the changes on it have nothing to change (``not-needed``)."""

    module: str
    name: str
    stages: Tuple[int, ...]
    optional: bool = False

    @property
    def stage_text(self) -> str:
        """``ZeRO-1/2``, ``ZeRO-3``: the stages as a job's description says them."""
        return "ZeRO-" + "/".join(str(stage) for stage in self.stages)

    @property
    def path(self) -> str:
        """The module's file inside DeepSpeed's source tree (``deepspeed/runtime/zero/stage3.py``)."""
        return self.module.replace(".", "/") + ".py"

    @property
    def stem(self) -> str:
        """The file's name without ``.py``: what ``patches/`` names its diffs after (``stage3-0.19.7.diff``)."""
        return self.module.rsplit(".", 1)[-1]

    def key(self, method: str) -> str:
        """The method's name in the fingerprint table and in ``status``'s findings: bare for ZeRO-1/2's class (the
        table's first target), ``Class.method`` for any other, so that two classes' ``step`` never meet."""
        return method if self == ZERO_1_2 else f"{self.name}.{method}"


#: ZeRO stages 1 and 2 (and ZenFlow, which subclasses it): the class of the upstream change.
ZERO_1_2 = Target("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", (1, 2))
#: ZeRO stage 3.
ZERO_3 = Target("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", (3, ))


@dataclass(frozen=True)
class Form:
    """One shape of the methods a change replaces, and the releases that have it.

    ``tracker`` is the one of ``methods`` whose finding says whether DeepSpeed has the fixed form already.
    ``first_release`` is the first release whose class has these methods in this shape, ``until`` the first that no
    longer has it (empty: every later one). ``functions`` names, for each method, its replacement in the change's
    ``methods`` module. ``witnesses`` are methods that are not replaced but whose code decides whether the
    replacements are right: they are fingerprinted too. Raises ValueError when ``tracker`` is not one of ``methods``
    or a method has no replacement.
    """

    methods: Tuple[str, ...]
    tracker: str
    first_release: str
    until: str = ""
    functions: Tuple[Tuple[str, str], ...] = ()
    witnesses: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tracker not in self.methods:
            raise ValueError(f"the tracker {self.tracker} is not one of the methods {self.methods}")
        if sorted(name for name, _ in self.functions) != sorted(self.methods):
            raise ValueError(f"{self.methods}: each method needs one replacement, not {self.functions}")

    @property
    def releases(self) -> str:
        """The releases whose class has these methods, as a version specifier (``>=0.14.0,<0.17.1``)."""
        return f">={self.first_release}" + (f",<{self.until}" if self.until else "")


@dataclass(frozen=True)
class Default:
    """A config default that a change sets instead of replacing methods: the pydantic field ``field`` of its target
    class (a DeepSpeed config model) defaults to ``value`` where DeepSpeed's default is ``unfixed``, on the releases
    from ``first_release`` up to ``until`` (empty: every later one). A key the user's config sets keeps its value."""

    field: str
    value: Any
    unfixed: Any
    first_release: str
    until: str = ""

    @property
    def releases(self) -> str:
        """The releases whose default is ``unfixed``, as a version specifier."""
        return f">={self.first_release}" + (f",<{self.until}" if self.until else "")


@dataclass(frozen=True)
class Change:
    """One change to a DeepSpeed optimizer class, as the package applies, reports, gates and diffs it.

    * ``name``: the one name, in code, ``patches/<name>/``, the switch (:attr:`switch`) and ``diff --<name>``.
    * ``title``: what messages call it (``the ... fix``); ``label``: its heading in ``status``.
    * ``forms``: the shapes of its methods, oldest first; the guard takes the one whose tracker the class defines.
    * ``methods``: returns the module of its replacement functions, importing it (and DeepSpeed with it) only when
      called: the package's import must not import DeepSpeed.
    * ``decide``: ``decide(change, cls, version) -> guard.Decision``, the guard's verdict on the class.
    * ``probe``: for a tracker in no known form: None when the class behaves as fixed, else what it did.
    * ``good_states``: the states in which ``check`` passes for it.
    * ``state_key``, ``reason_key``: its keys in ``status --json``.
    * ``upstream``: part of DeepSpeed pull request 8963. The upstream change has no switch of its own (only
      ``DS_OFFLOAD_PATCH_DISABLE``); every other change has one and ``DS_OFFLOAD_PATCH_UPSTREAM_ONLY=1`` leaves it out.
    * ``about``: what it changes, in a sentence or two (``patches/README.md``'s section on it).
    * ``diff_help``: ``diff --<name>``'s help (the upstream change's diff is ``diff``'s default).
    * ``defect``: ``(name, title)`` of the defect it fixes, as ``affected`` reports it; ``affects(job)`` gives
      ``(yes/no/maybe, why)`` for an offloaded ZeRO-1/2 job (None: every such job).
    * ``verify_checks``: the behavioural checks of ``ds-offload-patch verify`` (by their names there) that prove it,
      run where it is in a state other than ``not-needed`` or ``off``.
    * ``target``: the class whose methods it replaces (:data:`ZERO_1_2` unless it says otherwise).
    * ``default``: set (with no ``forms``) for a change that sets a config default (:class:`Default`) of its target
      class instead of replacing methods; its ``decide`` computes the class attributes that carry the new default.
    * ``opt_in``: set for a change that is off unless its switch is ``1``, and says why (``not yet proven on a GPU``):
      ``status`` reports it ``off`` with ``opt-in: <why>``, and ``affected``'s exit code does not count its defect.
    * ``wait``: for a defect that is a host wait per tensor on a GPU, its kind (``read``, ``event wait``, ...:
      :data:`deepspeed_offload_patch.waits.KINDS`); empty for a defect in what the job learns.
    * ``corrects_training``: where it applies, it changes what a job learns on purpose (DeepSpeed trains on the wrong
      gradient there, or applies a step with an inf/NaN): the equivalence harness then compares the patched runs that
      reach its defect with unpatched DeepSpeed plus the changes that correct training
      (``testing.equivalence.TRAINING_FIXED``), and the change's own tests prove it against an independent oracle.
    """

    name: str
    title: str
    label: str
    forms: Tuple[Form, ...]
    methods: Callable[[], Any]
    decide: Callable[..., Any]
    good_states: Tuple[State, ...]
    state_key: str
    reason_key: str
    upstream: bool = False
    probe: Optional[Callable[[type], Optional[str]]] = None
    about: str = ""
    diff_help: str = ""
    defect: Tuple[str, str] = ("", "")
    affects: Optional[Callable[[Any], Tuple[str, str]]] = None
    verify_checks: Tuple[str, ...] = ()
    corrects_training: bool = False
    target: Target = ZERO_1_2
    default: Optional[Default] = None
    opt_in: str = ""
    wait: str = ""

    @property
    def switch(self) -> Optional[str]:
        """The environment switch that leaves it out (``0``); None for the upstream change."""
        # One convention: the name in capitals after the package's prefix (a-name: DS_OFFLOAD_PATCH_A_NAME).
        return None if self.upstream else NAME_PREFIX + self.name.upper().replace("-", "_")

    @property
    def first_release(self) -> str:
        return self.forms[0].first_release if self.forms else self.default.first_release

    @property
    def method_names(self) -> Tuple[str, ...]:
        """Every method some form replaces or reads, in declaration order."""
        return tuple(dict.fromkeys(name for form in self.forms for name in form.methods + form.witnesses))

    def key(self, method: str) -> str:
        """:meth:`Target.key` of ``method`` in this change's class."""
        return self.target.key(method)

    def replacements(self, name: str) -> Tuple[Tuple[str, Callable], ...]:
        """``((release specifier, function), ...)``: the replacements of method ``name``, one per form that has it
        (empty for a method this change does not replace)."""
        module = None
        found = []
        for form in self.forms:
            for method, function in form.functions:
                if method == name:
                    module = module or self.methods()
                    found.append((form.releases, getattr(module, function)))
        return tuple(found)

    def form_of(self, release: str) -> Optional[Form]:
        """The form release ``release`` has; None for a release outside every form's range."""
        from packaging.specifiers import SpecifierSet
        return next((form for form in self.forms if SpecifierSet(form.releases).contains(release, prereleases=True)),
                    None)

    def covers(self, release: str) -> bool:
        """Whether release ``release`` has the defect in one of the forms (or the default) this change knows."""
        from packaging.specifiers import SpecifierSet
        if self.default is not None:
            return SpecifierSet(self.default.releases).contains(release, prereleases=True)
        return self.form_of(release) is not None

    def form_for(self, cls: type) -> Form:
        """The form that goes with ``cls``: the one whose tracker ``cls`` defines (the newest when it defines none,
        so that the guard reports the newest tracker as missing)."""
        for form in reversed(self.forms):
            if form.tracker in cls.__dict__:
                return form
        return self.forms[-1]
