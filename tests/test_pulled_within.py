"""``scenarios.route_verdict``: the rules the TP engine tests hold every attempt to, on
journals written here (P's ledger journal, the journals of the D ranks that read it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvproto.vllm import scenarios as sc


def _journal(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("\n".join([json.dumps({"header": True})]
                              + [json.dumps(r) for r in records]) + "\n")
    return path


def _p(tmp: Path, frees: dict[str, list[str]], dones: dict[str, list[str]]) -> Path:
    """A P journal: each request registered (handle = its index, an engine suffix on
    its id), the dones of ``dones[rid]``'s readers, then one free per reason listed."""
    recs: list[dict[str, Any]] = []
    rids = sorted(set(frees) | set(dones))
    for h, rid in enumerate(rids):
        recs.append({"event": {"type": "register", "handle": h, "request_id": f"{rid}-ab12"},
                     "effects": []})
    for h, rid in enumerate(rids):
        for reader in dones.get(rid, []):
            recs.append({"event": {"type": "done", "handle": h, "reader": reader},
                         "effects": []})
        for reason in frees.get(rid, []):
            recs.append({"event": {"type": "tick"},
                         "effects": [{"type": "free", "request_id": f"{rid}-ab12",
                                      "reason": reason}]})
    return _journal(tmp / "P.jsonl", recs)


def _d(tmp: Path, name: str, finished: dict[str, str]) -> Path:
    return _journal(tmp / name, [{"event": {"type": "read_result"},
                                  "effects": [{"type": "finished", "request_id": f"{r}-cd34",
                                               "reason": why}]}
                                 for r, why in finished.items()])


def test_two_readers_done_and_pulled_is_pulled(tmp_path: Path) -> None:
    pj = _p(tmp_path, {"a": ["transferred"]}, {"a": ["r0", "r1"]})
    djs = [_d(tmp_path, "D0", {"a": "pulled"}), _d(tmp_path, "D1", {"a": "pulled"})]
    got = sc.Pulled()
    assert sc.route_verdict(["a"], pj, djs, got) == {"a"}
    assert got.violations == [] and got.given_up == []


def test_transferred_on_one_reader_is_a_violation(tmp_path: Path) -> None:
    """The mutant the rule is for: P freed on the first reader's done."""
    pj = _p(tmp_path, {"a": ["transferred"]}, {"a": ["r0"]})
    djs = [_d(tmp_path, "D0", {"a": "pulled"}), _d(tmp_path, "D1", {"a": "lease_lost"})]
    got = sc.Pulled()
    assert sc.route_verdict(["a"], pj, djs, got) == set()
    assert len(got.violations) == 1 and "transferred" in got.violations[0]


def test_transferred_twice_by_one_reader_is_a_violation(tmp_path: Path) -> None:
    pj = _p(tmp_path, {"a": ["transferred"]}, {"a": ["r0", "r0"]})
    djs = [_d(tmp_path, "D0", {"a": "pulled"}), _d(tmp_path, "D1", {"a": "pulled"})]
    got = sc.Pulled()
    assert sc.route_verdict(["a"], pj, djs, got) == set() and len(got.violations) == 1


def test_transferred_but_not_pulled_on_a_d_rank_is_a_violation(tmp_path: Path) -> None:
    pj = _p(tmp_path, {"a": ["transferred"]}, {"a": ["r0", "r1"]})
    djs = [_d(tmp_path, "D0", {"a": "pulled"}), _d(tmp_path, "D1", {"a": "fenced"})]
    got = sc.Pulled()
    assert sc.route_verdict(["a"], pj, djs, got) == set() and len(got.violations) == 1


def test_given_up_by_a_d_rank_and_released_or_expired_is_retried(tmp_path: Path) -> None:
    pj = _p(tmp_path, {"a": ["released"], "b": ["expired"]}, {"a": ["r0"]})
    djs = [_d(tmp_path, "D0", {"a": "pulled", "b": "fenced"}),
           _d(tmp_path, "D1", {"a": "lease_lost", "b": "fenced"})]
    got = sc.Pulled()
    assert sc.route_verdict(["a", "b"], pj, djs, got) == set()
    assert got.violations == []
    assert [(i, why) for _, i, why, _ in got.given_up] == [("a", "released"), ("b", "expired")]
    assert got.given_up[0][3] == {"D0": ["pulled"], "D1": ["lease_lost"]}


def test_released_although_every_d_rank_pulled_is_a_violation(tmp_path: Path) -> None:
    pj = _p(tmp_path, {"a": ["released"]}, {})
    djs = [_d(tmp_path, "D0", {"a": "pulled"})]
    got = sc.Pulled()
    assert sc.route_verdict(["a"], pj, djs, got) == set() and len(got.violations) == 1


def test_freed_twice_never_or_for_another_reason_is_a_violation(tmp_path: Path) -> None:
    pj = _p(tmp_path, {"a": ["transferred", "expired"], "c": ["aborted"]},
            {"a": ["r0"], "b": []})
    djs = [_d(tmp_path, "D0", {"a": "pulled", "c": "aborted"})]
    got = sc.Pulled()
    assert sc.route_verdict(["a", "b", "c"], pj, djs, got) == set()
    assert len(got.violations) == 3, got.violations
    assert got.given_up == []


def test_prompt_ids_with_a_dash_are_refused_before_any_request() -> None:
    """Journals name a request by the id before its first "-": such a prompt would be
    judged under another's name. ``pd`` is never touched."""
    with pytest.raises(ValueError, match="must not contain"):
        sc.pulled_within(None, {"a-1": [1, 2]}, {"a-1": [3]}, [],  # type: ignore[arg-type]
                         max_tokens=1, free_timeout=1.0)


def test_orphan_released_once_counts_expired_is_retried(tmp_path: Path) -> None:
    """A P rank no D rank reads: D's release frees it (``released``); a lease expiry
    there is a late release (another attempt), not broken safety."""
    pj = _p(tmp_path, {"a": ["released"], "b": ["expired"]}, {})
    got = sc.Pulled()
    assert sc.orphan_verdict(["a", "b"], pj, got) == {"a"}
    assert got.violations == []
    assert [(i, why) for _, i, why, _ in got.given_up] == [("b", "expired")]


def test_orphan_transferred_twice_or_never_freed_is_a_violation(tmp_path: Path) -> None:
    """The mutants the rule is for: a P rank that takes a done for blocks nobody read,
    one that frees twice, and one that never frees."""
    pj = _p(tmp_path, {"a": ["transferred"], "b": ["released", "expired"]}, {"a": ["r0"]})
    got = sc.Pulled()
    assert sc.orphan_verdict(["a", "b", "c"], pj, got) == set()
    assert len(got.violations) == 3, got.violations
    assert got.given_up == []


def test_a_d_rank_reading_in_parts_is_judged_per_part(tmp_path: Path) -> None:
    """Head slices: one D rank reads request ``a`` in two parts, one per P rank (ids
    ``a-…`` and ``a-…#p1``). P rank 1's route looks at part ``p1`` only: its release
    after that part failed is a given-up request, and a transferred free there needs
    that part pulled, whatever the other part did."""
    d = _journal(tmp_path / "D", [
        {"event": {"type": "read_result"},
         "effects": [{"type": "finished", "request_id": "a-cd34", "reason": "pulled"},
                     {"type": "finished", "request_id": "a-cd34#p1", "reason": "fenced"},
                     {"type": "finished", "request_id": "b-cd34", "reason": "fenced"},
                     {"type": "finished", "request_id": "b-cd34#p1", "reason": "pulled"}]}])
    p1 = _p(tmp_path, {"a": ["released"], "b": ["transferred"]}, {"b": ["r0"]})
    got = sc.Pulled()
    assert sc.route_verdict(["a", "b"], p1, [(d, "p1")], got) == {"b"}
    assert got.violations == []
    assert [(i, why, how) for _, i, why, how in got.given_up] == [
        ("a", "released", {"D#p1": ["fenced"]})]
    # judged on the whole journal instead, a's release looks like a pulled request's
    whole = sc.Pulled()
    sc.route_verdict(["a"], p1, [d], whole)
    assert len(whole.violations) == 1 and "released" in whole.violations[0]
    # and part "" (the part without a suffix) is a's pulled part
    part0 = _p(tmp_path, {"a": ["transferred"]}, {"a": ["r0"]})
    assert sc.route_verdict(["a"], part0, [(d, "")], sc.Pulled()) == {"a"}
