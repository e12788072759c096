"""Hypothesis state machines over the lifecycle drivers, and the record mode of the long run.

Each machine owns one driver (a fresh engine or module per example) and offers its rules under their
preconditions: updates when no session is open; load / finish / abort / crash while one is; serving
calls in both. The invariant runs :meth:`Driver.check` after every step, teardown closes the sequence
(open session aborted, a good full update, hygiene counts).

Record mode (the long run): a :class:`Recorder` is installed; a violation is counted with the steps that
led to it, and the sequence starts again on a fresh driver instead of failing the run.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.reload._fuzz_drivers import STATS, Driver, EngineDriver, HypothesisDraw, PlainDriver
from tests.reload._fuzz_world import Violation


@dataclass
class Recorder:
    """Violations by kind, each with the shortest step log seen; sequences and steps run."""

    sequences: int = 0
    steps: int = 0
    violations: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, machine: str, exc: BaseException, log: list) -> None:
        kind = type(exc).__name__ if isinstance(exc, Violation) else f"UnexpectedError:{type(exc).__name__}"
        entry = self.violations.setdefault(kind, {"count": 0, "machines": {}, "example": None})
        entry["count"] += 1
        entry["machines"][machine] = entry["machines"].get(machine, 0) + 1
        if entry["example"] is None or len(log) < len(entry["example"]["steps"]):
            msg = str(exc) if isinstance(exc, Violation) else "".join(traceback.format_exception(exc))[-2000:]
            entry["example"] = {"machine": machine, "message": msg[:2000],
                                "steps": [[r, {k: _plain(v) for k, v in p.items()}] for r, p in log]}


def _plain(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)


RECORDER: Recorder | None = None


def machine_settings(max_examples: int, steps: int) -> settings:
    """Reproducible CI settings: derandomized, no example database, no deadline."""
    return settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None, derandomize=True,
        database=None, print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


class LifecycleMachine(RuleBasedStateMachine):
    """Rules of the reload lifecycle over one driver."""

    def __init__(self) -> None:
        super().__init__()
        self.d: Driver = self.make_driver()
        if RECORDER is not None:
            RECORDER.sequences += 1

    def make_driver(self) -> Driver:
        raise NotImplementedError

    def _run(self, fn) -> None:
        if RECORDER is None:
            fn()
            return
        RECORDER.steps += 1
        try:
            fn()
        except Exception as e:
            RECORDER.add(type(self).__name__, e, self.d.log)
            self.d = self.make_driver()  # the rest of the sequence runs on a fresh model
            STATS["restarts"] += 1

    def _rule(self, name: str, data: Any) -> None:
        self._run(lambda: getattr(self.d, name)(HypothesisDraw(data)))

    # ---- no session open
    @precondition(lambda self: self.d.session is None)
    @rule(data=st.data())
    def full_update(self, data) -> None:
        self._rule("full_update", data)

    @precondition(lambda self: self.d.session is None)
    @rule(data=st.data())
    def partial_update(self, data) -> None:
        self._rule("partial_update", data)

    @precondition(lambda self: self.d.session is None)
    @rule(data=st.data())
    def faulty_update(self, data) -> None:
        self._rule("faulty_update", data)

    @precondition(lambda self: self.d.session is None)
    @rule(data=st.data())
    def seed_alias_update(self, data) -> None:
        self._rule("seed_alias_update", data)

    @precondition(lambda self: self.d.session is None)
    @rule(data=st.data())
    def begin(self, data) -> None:
        self._rule("begin", data)

    # ---- a session open
    @precondition(lambda self: self.d.session is not None and bool(self.d.open["pending"]))
    @rule(data=st.data())
    def load_next(self, data) -> None:
        self._rule("load_next", data)

    @precondition(lambda self: self.d.session is not None)
    @rule(data=st.data())
    def finish(self, data) -> None:
        self._rule("finish", data)

    @precondition(lambda self: self.d.session is not None)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self._rule("abort_open", data)

    @precondition(lambda self: self.d.session is not None)
    @rule(data=st.data())
    def caller_raises(self, data) -> None:
        self._rule("caller_raises", data)

    # ---- both
    @precondition(lambda self: self.d.serves)
    @rule(data=st.data())
    def serve(self, data) -> None:
        self._rule("serve", data)

    @invariant()
    def serves_one_committed_version_or_refuses(self) -> None:
        self._run(self.d.check)

    def teardown(self) -> None:
        self._run(self.d.final_check)
        self._run(self.d.check_hygiene)


class Fp8EngineMachine(LifecycleMachine):
    def make_driver(self) -> Driver:
        return EngineDriver("fp8")


class Bf16EngineMachine(LifecycleMachine):
    def make_driver(self) -> Driver:
        return EngineDriver("bf16")


class Fp32EngineMachine(LifecycleMachine):
    def make_driver(self) -> Driver:
        return EngineDriver("fp32")


class MoeFp8EngineMachine(LifecycleMachine):
    """Tiny Qwen3-MoE, experts and linears quantized online to fp8 with per-tensor scales."""

    def make_driver(self) -> Driver:
        return EngineDriver("fp8", arch="qwen3_moe")


class MoeFp8BlockEngineMachine(LifecycleMachine):
    """Tiny Qwen3-MoE, experts and linears quantized online to fp8 with 128x128 block scales."""

    def make_driver(self) -> Driver:
        return EngineDriver("fp8_block", arch="qwen3_moe")


class PlainModuleMachine(LifecycleMachine):
    def make_driver(self) -> Driver:
        return PlainDriver()


MACHINES = {
    "fp8": Fp8EngineMachine,
    "bf16": Bf16EngineMachine,
    "fp32": Fp32EngineMachine,
    "moe_fp8": MoeFp8EngineMachine,
    "moe_fp8_block": MoeFp8BlockEngineMachine,
    "plain": PlainModuleMachine,
}
