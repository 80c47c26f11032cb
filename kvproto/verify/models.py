"""The one registry of named verification models.

Two kinds, one namespace (``kvproto check --list`` and ``python -m
kvproto.verify.conformance`` name them):

* :class:`TlcModel` -- a TLC configuration ``kvproto/tla/MC_*.cfg`` of the whole
  lifecycle and what TLC must conclude about it (``kvproto check``);
* :class:`GraphModel` -- a small bounded configuration of the ledger alone, the same for
  TLC and for a BFS of the Python ``Ledger`` (state-graph equality, the step oracle).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeAlias

from kvproto.lifecycle import Config
from kvproto.verify.tlc import render, spec_dir

# One model time unit in the machines' milliseconds. A model's terms are small numbers of
# units, and each graph model's Config takes them as seconds, so that its heartbeat and
# READ bounds (a few ms, which the ledger alone never reads) fit below a one-unit term.
UNIT_MS: Final = 1000


@dataclass(frozen=True)
class TlcModel:
    """A named TLC configuration of ``kvproto/tla/MC.tla`` and what TLC must conclude."""

    name: str
    cfg: str  # file name under kvproto/tla/
    about: str
    expect: str | None = None  # None: must pass; else the property that must be violated
    ci: bool = True  # run by `kvproto check --all` and the test suite
    module: str = "MC"  # the root module the cfg configures (e.g. MC_gate, MC_coverage)

    @property
    def path(self) -> Path:
        return spec_dir() / self.cfg


_TLC: Final[tuple[TlcModel, ...]] = (
    TlcModel("ci", "MC_ci.cfg",
          "2 requests x 2 readers (fan-in 2) x 1 sibling group sharing a block, early "
          "messages, 1 loss, 1 duplicate, 1 D crash; every safety invariant"),
    TlcModel("live", "MC_live.cfg",
          "liveness under fairness of Tick and delivery: NoLeak and ReportedIsFreed "
          "(1 request x 1 reader, early messages, 1 loss, 1 crash, aborts on P and D)"),
    TlcModel("faults", "MC_faults.cfg",
          "every action and fault reachable: 1 request x 2 readers, D ranks that start "
          "without a handshake, one of each fault but duplication (loss, crash, aborts on "
          "P and D, READ error, failed handshake); every safety invariant"),
    TlcModel("lease", "MC_lease.cfg",
          "the safety model `--lease-config` fills in: 1 request x 2 readers, 1 loss, "
          "1 crash, 1 abort on P; every safety invariant, with the default Config"),
    TlcModel("lease_live", "MC_lease_live.cfg",
          "NoLeak for `--lease-config`: 1 request x 1 reader, 1 loss, 1 crash, aborts on "
          "P and D, at a coarse unit (the default Config here)"),
    TlcModel("large", "MC_large.cfg",
          "every fault at once with a sibling group and early messages: 2 requests x 1 "
          "reader that starts without a handshake, one each of loss, duplicate, crash, "
          "aborts on P and D, READ error, failed handshake, peer loss; READs span a Tick",
          ci=False),
    TlcModel("full", "MC_full.cfg",
          "every fault at once with fan-in: large with 2 readers; more than one machine's "
          "work, for TLC's distributed mode (spec/TLA.md)",
          ci=False),
    TlcModel("bug_count_messages", "MC_bug_count_messages.cfg",
          "BUG: P counts done messages instead of distinct readers (vLLM's fan-in "
          "count), so a duplicated done frees blocks another reader is still reading",
          expect="NoFreeUnderRead"),
    TlcModel("bug_abort_frees_now", "MC_bug_abort_frees_now.cfg",
          "BUG: an abort after prefill finished frees the blocks at once, under a READ "
          "that D started within its lease", expect="NoFreeUnderRead"),
    TlcModel("bug_drop_early", "MC_bug_drop_early.cfg",
          "BUG: notifications that arrive before register are dropped, so a request "
          "every reader reported stays pinned until its lease runs out",
          expect="ReportedIsFreed"),
    TlcModel("bug_short_extension", "MC_bug_short_extension.cfg",
          "BUG: lease extension shorter than heartbeat interval + delay, so P expires "
          "requests whose reader is alive and heartbeating", expect="RenewalKeepsLease"),
    TlcModel("coverage", "MC_coverage.cfg",
          "D's coverage machine (KVCoverage): 2 requests, P TP 2 -> D TP 1 and a "
          "replicated head read from one P rank, any subset of a part's regions read; "
          "Coverage", module="MC_coverage"),
    TlcModel("bug_drop_region", "MC_bug_drop_region.cfg",
          "BUG: D's part_read guard ignores one region (mutant drop_region), so a request "
          "is reported complete with a region never read", expect="Coverage",
          module="MC_coverage"),
    TlcModel("bug_one_part", "MC_bug_one_part.cfg",
          "BUG: a part read completes the request while other parts are pending (mutant "
          "one_part), so a split request is reported complete with the other P rank's "
          "regions never read", expect="Coverage", module="MC_coverage"),
    TlcModel("gate", "MC_gate.cfg",
          "P's gate: 2 requests x 3 consumers holding the same params and 1 without them "
          "(a forger), chunked prefill, aborts after the params left, a gate that may be "
          "full, releases and heartbeats from any consumer; NoFreeUnderRead per claimant, "
          "ReadinessHolds, NeverToldAtOnce, OneConsumerServed, OnlyHoldersBind, "
          "NoGrantBeforeRegister",
          module="MC_gate"),
    TlcModel("bug_skip_binding", "MC_bug_skip_binding.cfg",
          "BUG: a second consumer of a bound handle (router retry) is let through; the "
          "first one's done frees the blocks under its READ", expect="NoFreeUnderRead",
          module="MC_gate"),
    TlcModel("bug_register_unready", "MC_bug_register_unready.cfg",
          "BUG: a register after an earlier chunk of a chunked prefill reaches the ledger",
          expect="ReadinessHolds", module="MC_gate"),
    TlcModel("bug_skip_capability", "MC_bug_skip_capability.cfg",
          "BUG: a wrong capability binds like the right one: a consumer that never got "
          "the params binds the handle and is served", expect="OnlyHoldersBind",
          module="MC_gate"),
    TlcModel("bug_no_never_notice", "MC_bug_no_never_notice.cfg",
          "BUG: an aborted prefill whose params left tells no consumer: D waits for a "
          "timeout", expect="NeverToldAtOnce", module="MC_gate"),
    TlcModel("bug_read_before_grant", "MC_bug_read_before_grant.cfg",
          "BUG: D reads before the gate granted its claim (a router retry's READ races "
          "the bound consumer, whose done frees the blocks under it)",
          expect="NoFreeUnderRead", module="MC_gate"),
)


@dataclass(frozen=True)
class Action:
    """One input instance: ``label`` is the TLA+ operator name of the generated action."""

    label: str
    kind: str  # register | done | heartbeat | release | abort | tick
    request: str = ""
    reader: str = ""
    expected: int = 0


@dataclass(frozen=True)
class GraphModel:
    """A small bounded model, the same for TLC and for the Python BFS.

    Time is in discrete units (Python time = TLA+ units * ``UNIT_MS``, always a whole
    number of units). Blocks are 1..n in TLA+ and
    0..n-1 in Python. Handles are 1..len(requests) in Python, request names in TLA+."""

    name: str
    requests: tuple[str, ...]
    readers: tuple[str, ...]
    blocks_of: Mapping[str, tuple[int, ...]]
    group_of: Mapping[str, str | None]
    reg_expected: Mapping[str, int]
    expected_values: tuple[int, ...] = (0, 2)  # expected readers announced by done/release
    hb_expected: tuple[int, ...] | None = None  # ... by heartbeat (None: expected_values)
    initial_lease: int = 1
    lease_extension: int = 2
    abort_grace: int = 2
    max_staged: int = 1
    max_staged_msgs: int = 1
    max_staged_age: int = 2
    doc: str = ""

    @property
    def capacity(self) -> int:
        return max(b for bs in self.blocks_of.values() for b in bs)

    def handle(self, r: str) -> int:
        return self.requests.index(r) + 1

    def config(self) -> Config:
        """The Python Config with the same terms, one unit a second (``UNIT_MS``; timing
        checks satisfied with tiny heartbeat/READ bounds; they do not affect the ledger)."""
        return Config(initial_lease=float(self.initial_lease),
                      lease_extension=float(self.lease_extension),
                      abort_grace=float(self.abort_grace), heartbeat_interval=0.01,
                      max_delay=0.0, max_read_time=0.01, clock_drift=0.0,
                      max_staged=self.max_staged, max_staged_age=float(self.max_staged_age),
                      max_tombstones=len(self.requests) + 1,
                      max_groups_remembered=len(self.requests) + 1).validate()

    def actions(self) -> list[Action]:
        acts: list[Action] = []
        for r in self.requests:
            acts.append(Action(f"Register_{r}", "register", r))
            acts.append(Action(f"Abort_{r}", "abort", r))
            for d in self.readers:
                for kind in ("done", "heartbeat", "release"):
                    values = self.expected_values if kind != "heartbeat" or \
                        self.hb_expected is None else self.hb_expected
                    for e in values:
                        acts.append(Action(f"{kind.capitalize()}_{r}_{d}_{e}", kind, r, d, e))
        acts.append(Action("Tick_", "tick"))
        return acts

    # -- TLA+ -----------------------------------------------------------------------
    def module_name(self) -> str:
        return f"MC_conf_{self.name}"

    def tla_module(self) -> str:
        def tset(xs: Sequence[Any]) -> str:
            return "{" + ", ".join(render(x) for x in xs) + "}"

        def tfun(m: Mapping[str, Any], conv: Callable[[Any], str]) -> str:
            return "[r \\in Requests |-> CASE " + " [] ".join(
                f'r = "{r}" -> {conv(m[r])}' for r in self.requests) + "]"

        lines = [f"---- MODULE {self.module_name()} ----",
                 f"(* GENERATED by kvproto.verify.conformance from GraphModel {self.name!r}: do not edit. *)",
                 f"(* {self.doc} *)" if self.doc else "",
                 "EXTENDS KVLedger",
                 f"CBlocksOf == {tfun(self.blocks_of, tset)}",
                 f"CGroupOf == {tfun(self.group_of, lambda g: render(g or 'none'))}",
                 f"CRegExpected == {tfun(self.reg_expected, str)}"]
        for a in self.actions():
            # The conjunction makes this zero-arity operator the leaf TLC names the
            # edge after (a bare alias would be labelled with KVLedger's "Write").
            if a.kind == "tick":
                lines.append(f"{a.label} == Tick /\\ TRUE")
            elif a.kind in ("register", "abort"):
                lines.append(f'{a.label} == {a.kind.capitalize()}("{a.request}") /\\ TRUE')
            else:
                lines.append(f'{a.label} == {a.kind.capitalize()}("{a.request}", '
                             f'"{a.reader}", {a.expected}) /\\ TRUE')
        lines.append("ConfNext ==")
        lines += [f"    \\/ {a.label}" for a in self.actions()]
        lines.append("====")
        return "\n".join(x for x in lines if x) + "\n"

    def tla_cfg(self) -> str:
        return "\n".join([
            "CONSTANTS",
            f"    Requests = {{{', '.join(render(r) for r in self.requests)}}}",
            f"    Readers = {{{', '.join(render(d) for d in self.readers)}}}",
            f"    Blocks = {{{', '.join(str(b) for b in range(1, self.capacity + 1))}}}",
            '    NoGroup = "none"',
            "    BlocksOf <- CBlocksOf",
            "    GroupOf <- CGroupOf",
            "    RegExpected <- CRegExpected",
            f"    InitialLease = {self.initial_lease}",
            f"    LeaseExtension = {self.lease_extension}",
            f"    AbortGrace = {self.abort_grace}",
            f"    MaxStaged = {self.max_staged}",
            f"    MaxStagedMsgs = {self.max_staged_msgs}",
            f"    MaxStagedAge = {self.max_staged_age}",
            f"    LedgerMaxExpected = {max(self.expected_values + (self.hb_expected or ()))}",
            "    BugCountMessages = FALSE",
            "    BugDropEarly = FALSE",
            "    BugAbortFreesNow = FALSE",
            "INIT LedgerInit",
            "NEXT ConfNext",
            "INVARIANT LedgerTypeOK NoDoubleFree Conservation StagingBounded",
            "",
        ])

    def write_tla(self, directory: Path) -> Path:
        """Write the harness files TLC needs into ``directory``; return the module path."""
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copy(spec_dir() / "KVLedger.tla", directory / "KVLedger.tla")
        mod = directory / f"{self.module_name()}.tla"
        mod.write_text(self.tla_module(), encoding="utf-8")
        (directory / f"{self.module_name()}.cfg").write_text(self.tla_cfg(), encoding="utf-8")
        return mod


# The graph-equality models (CI). Sizes and times are in BENCHMARKS.md.
_GRAPH: Final[tuple[GraphModel, ...]] = (
    GraphModel("group2x2", ("r1", "r2"), ("d1", "d2"),
          {"r1": (1, 2), "r2": (1, 3)}, {"r1": "g1", "r2": "g1"}, {"r1": 0, "r2": 0},
          expected_values=(0, 2), hb_expected=(0,), max_staged=1, max_staged_msgs=1,
          doc="2 requests x 2 readers, one sibling group, a shared block, readers announced "
              "by done/release"),
    GraphModel("solo2x2", ("r1", "r2"), ("d1", "d2"),
          {"r1": (1, 2), "r2": (2,)}, {"r1": None, "r2": None}, {"r1": 2, "r2": 1},
          expected_values=(0,), max_staged=1, max_staged_msgs=2, initial_lease=2,
          lease_extension=2, abort_grace=2, max_staged_age=2,
          doc="no group, expected readers known at register, 2 staged messages per handle"),
    GraphModel("announce1x2", ("r1",), ("d1", "d2"),
          {"r1": (1,)}, {"r1": None}, {"r1": 0},
          expected_values=(0, 1, 2), max_staged=1, max_staged_msgs=2, initial_lease=1,
          lease_extension=2, abort_grace=2, max_staged_age=2,
          doc="1 request x 2 readers, expected readers announced (and raised) by every input, "
              "early messages staged"),
)


Model: TypeAlias = TlcModel | GraphModel

_ALL: Final[tuple[Model, ...]] = (*_TLC, *_GRAPH)
MODELS: Final[dict[str, Model]] = {m.name: m for m in _ALL}
assert len(MODELS) == len(_TLC) + len(_GRAPH), "model names must be unique"
TLC_MODELS: Final[dict[str, TlcModel]] = {
    n: m for n, m in MODELS.items() if isinstance(m, TlcModel)}
GRAPH_MODELS: Final[dict[str, GraphModel]] = {
    n: m for n, m in MODELS.items() if isinstance(m, GraphModel)}
