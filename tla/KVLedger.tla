------------------------------ MODULE KVLedger ------------------------------
(***************************************************************************)
(* P's KV-block ledger: one P rank's lifecycle machine, as TLA+ actions    *)
(* over abstract inputs. Mirrors kvproto.lifecycle.Ledger ONE TO ONE: same *)
(* state names, same events, same guards (the guard names of               *)
(* kvproto.lifecycle.P_TRANSITIONS are quoted in the comments).            *)
(*                                                                         *)
(* The ledger is written as pure operators over a record L (the whole      *)
(* ledger state) so that a message batch (staged messages applied at       *)
(* Register, the sibling cascade) is a fold; every action then writes the  *)
(* record back to the variables. KVLifecycle.tla instantiates this module  *)
(* and adds D ranks, the network and time.                                 *)
(*                                                                         *)
(* MAPPING Python Ledger -> variables (the abstraction function used by    *)
(* the state-graph equality check). One request = one handle = one        *)
(* request id (the model uses the same name r for both).                   *)
(*                                                                         *)
(*   pstate[r]    Ledger.state(r): "unregistered" (not live, no tombstone),*)
(*                "registered"/"leased"/"notified"/"aborted" (live,        *)
(*                snapshot()[r][0]), "expired"/"freed" (tombstone _tomb[r])*)
(*   expected[r]  snapshot()[r][1] (live), 0 when not live                 *)
(*   finished[r]  snapshot()[r][2] (set of reader names), {} when not live *)
(*   released[r]  snapshot()[r][3], FALSE when not live                    *)
(*   deadline[r]  snapshot()[r][4] - Ledger.now (time is RELATIVE: the     *)
(*                remaining lease; Tick decrements it), 0 when not live    *)
(*   reports[r]   len(snapshot()[r][2]) in the correct ledger (the number  *)
(*                of counted reports; differs only under BugCountMessages) *)
(*   rc[b]        pool.refcount(b)                                         *)
(*   stagedQ      the handles of staged_entries(), oldest first            *)
(*   staged[r]    its staged_entries() messages as a sequence of records   *)
(*                [kind, reader, exp, age]; age = now - arrival, kept only *)
(*                for "heartbeat" (the only kind whose arrival time is     *)
(*                used, by _renew); 0 for done/release; <<>> if not staged *)
(*   stagedAge[r] now - its staged_entries() since, 0 if not staged        *)
(*   groupsDone   set(Ledger.groups_done())                                *)
(*   nfree[r]     GHOST (not Python state): how many times r was freed;    *)
(*                Python counts the same thing in pool.violations/frees    *)
(* Derived, not variables: Ledger._groups[g] = {r : GroupOf[r] = g and     *)
(* pstate[r] held}; Ledger._by_rid = the live requests; the deadline heap  *)
(* is an implementation detail of tick (lazy), not state.                  *)
(*                                                                         *)
(* Abstractions (documented in spec/TLA.md):                               *)
(*  - time is discrete and relative; Tick(now+1) is Python tick(now + 1)   *)
(*    (a tick without time passing only matters after an abort with        *)
(*    AbortGrace = 0; the model frees that request at the next Tick);      *)
(*  - tombstones and the transferred-group memory are not evicted (ASSUME  *)
(*    max_tombstones, max_groups_remembered >= number of requests/groups); *)
(*  - counters (stale, late, refused, duplicate ...) are not state;        *)
(*  - register of an already known handle is a rejection that changes no  *)
(*    state, so Register(r) is only enabled for unregistered r;            *)
(*  - malformed input (Ledger.reject) changes no state: not modelled.      *)
(***************************************************************************)
EXTENDS Naturals, Integers, Sequences, FiniteSets

CONSTANTS
    Requests,        \* request handles (= request ids)
    Readers,         \* reader (D rank) names
    Blocks,          \* block ids of the pool (capacity = Cardinality(Blocks))
    BlocksOf,        \* [Requests -> SUBSET Blocks]: blocks held by a request (may overlap)
    GroupOf,         \* [Requests -> Groups \cup {NoGroup}]: sibling group
    NoGroup,         \* "no sibling group"
    RegExpected,     \* [Requests -> Nat]: expected readers announced at register (0 = unknown)
    InitialLease,    \* Config.initial_lease (time units)
    LeaseExtension,  \* Config.lease_extension
    AbortGrace,      \* Config.abort_grace
    MaxStaged,       \* Config.max_staged (handles)
    MaxStagedMsgs,   \* MAX_STAGED_MSGS_PER_HANDLE
    MaxStagedAge,    \* Config.max_staged_age
    BugCountMessages,\* BUG (a): count report messages instead of distinct readers
    BugDropEarly,    \* BUG (c): drop early (pre-register) messages instead of staging them
    BugAbortFreesNow \* BUG (b): an abort after prefill finished frees at once (no grace)

VARIABLES pstate, expected, finished, released, deadline, reports, rc,
          stagedQ, staged, stagedAge, groupsDone, nfree

ledgerVars == <<pstate, expected, finished, released, deadline, reports, rc,
                stagedQ, staged, stagedAge, groupsDone, nfree>>

-----------------------------------------------------------------------------
(* Names: the strings of kvproto.lifecycle *)
PStates  == {"unregistered", "registered", "leased", "notified", "aborted", "expired", "freed"}
Held     == {"registered", "leased", "notified", "aborted"}   \* HELD_STATES
HeldLive == {"registered", "leased", "notified"}              \* _HELD_LIVE
Terminal == {"expired", "freed"}                              \* TERMINAL_STATES
MsgKinds == {"done", "release", "heartbeat"}
Groups   == {GroupOf[r] : r \in Requests} \ {NoGroup}

Max(a, b) == IF a >= b THEN a ELSE b
Min(a, b) == IF a <= b THEN a ELSE b
Range(s)  == {s[i] : i \in DOMAIN s}
Remove(s, x) == SelectSeq(s, LAMBDA y : y # x)

(* The ledger as one record, so that batches are folds. *)
Cur == [pstate |-> pstate, expected |-> expected, finished |-> finished,
        released |-> released, deadline |-> deadline, reports |-> reports, rc |-> rc,
        stagedQ |-> stagedQ, staged |-> staged, stagedAge |-> stagedAge,
        groupsDone |-> groupsDone, nfree |-> nfree]

Write(L) == /\ pstate' = L.pstate /\ expected' = L.expected /\ finished' = L.finished
            /\ released' = L.released /\ deadline' = L.deadline /\ reports' = L.reports
            /\ rc' = L.rc /\ stagedQ' = L.stagedQ /\ staged' = L.staged
            /\ stagedAge' = L.stagedAge /\ groupsDone' = L.groupsDone /\ nfree' = L.nfree

-----------------------------------------------------------------------------
(* Pure operators on a ledger record L. *)

(* Ledger._free over a set S of live requests, all moving to terminal state dst:
   the ONLY place blocks are dropped. Per-request fields are reset (not live). *)
FreeSet(L, S, dst) ==
    [L EXCEPT !.pstate   = [q \in Requests |-> IF q \in S THEN dst ELSE L.pstate[q]],
              !.rc       = [b \in Blocks |-> L.rc[b] - Cardinality({q \in S : b \in BlocksOf[q]})],
              !.nfree    = [q \in Requests |-> IF q \in S THEN L.nfree[q] + 1 ELSE L.nfree[q]],
              !.expected = [q \in Requests |-> IF q \in S THEN 0 ELSE L.expected[q]],
              !.finished = [q \in Requests |-> IF q \in S THEN {} ELSE L.finished[q]],
              !.released = [q \in Requests |-> IF q \in S THEN FALSE ELSE L.released[q]],
              !.deadline = [q \in Requests |-> IF q \in S THEN 0 ELSE L.deadline[q]],
              !.reports  = [q \in Requests |-> IF q \in S THEN 0 ELSE L.reports[q]]]

Free(L, r, dst) == FreeSet(L, {r}, dst)

(* Ledger._group_transferred: remember g; free members in registered/leased/aborted
   (row SIBLING/group_transferred, free:sibling); leave notified members
   (row SIBLING/reader_active). *)
GroupTransferred(L, g) ==
    LET L1 == [L EXCEPT !.groupsDone = L.groupsDone \cup {g}]
        S  == {q \in Requests : GroupOf[q] = g /\ L.pstate[q] \in {"registered", "leased", "aborted"}}
    IN  FreeSet(L1, S, "freed")

(* Ledger._announce: expected readers only ever go up. *)
Announce(L, r, e) ==
    IF e > L.expected[r] THEN [L EXCEPT !.expected[r] = e] ELSE L

(* Ledger._finish: reader d finished r (kind "done" or "release"). r is live.
   Guards: duplicate_reader, more_readers, all_done (free:transferred, then the
   sibling cascade), all_finished (free:released). *)
Finish(L, r, kind, d, e) ==
    LET L1  == Announce(L, r, e)
        dup == d \in L1.finished[r]
    IN  IF dup /\ ~BugCountMessages
        THEN L1                                             \* duplicate_reader: state unchanged
        ELSE LET L2 == [L1 EXCEPT !.finished[r] = @ \cup {d},
                                  !.released[r] = @ \/ (kind = "release" /\ ~dup),
                                  !.reports[r]  = @ + 1]
                 n  == IF BugCountMessages THEN L2.reports[r] ELSE Cardinality(L2.finished[r])
             IN  IF L2.expected[r] > 0 /\ n >= L2.expected[r]
                 THEN IF L2.released[r]
                      THEN Free(L2, r, "freed")                       \* all_finished
                      ELSE IF GroupOf[r] # NoGroup                    \* all_done
                           THEN GroupTransferred(Free(L2, r, "freed"), GroupOf[r])
                           ELSE Free(L2, r, "freed")
                 ELSE IF L2.pstate[r] = "aborted"                     \* more_readers
                      THEN L2
                      ELSE [L2 EXCEPT !.pstate[r] = "notified"]

(* Ledger._stage: an early message for an unregistered handle. At MaxStaged handles
   the oldest handle's entry is dropped; at MaxStagedMsgs messages the new one is. *)
Stage(L, r, kind, d, e) ==
    LET new == r \notin Range(L.stagedQ)
        evict == new /\ Len(L.stagedQ) >= MaxStaged
        old == Head(L.stagedQ)
        L1 == IF evict
              THEN [L EXCEPT !.stagedQ = Tail(@), !.staged[old] = <<>>, !.stagedAge[old] = 0]
              ELSE L
        L2 == IF new THEN [L1 EXCEPT !.stagedQ = Append(@, r), !.stagedAge[r] = 0] ELSE L1
    IN  IF Len(L2.staged[r]) >= MaxStagedMsgs
        THEN L2
        ELSE [L2 EXCEPT !.staged[r] = Append(@, [kind |-> kind, reader |-> d, exp |-> e, age |-> 0])]

(* Ledger._not_live: tombstoned -> late/stale (no change); else early -> stage. *)
NotLive(L, r, kind, d, e) ==
    IF L.pstate[r] \in Terminal THEN L
    ELSE IF BugDropEarly THEN L
    ELSE Stage(L, r, kind, d, e)

(* Ledger._renew (a staged heartbeat applied at register; age = now - arrival).
   Like a live heartbeat, it first announces the expected readers it carries
   (Ledger.register's loop calls Ledger._announce before Ledger._renew). *)
Renew(L, r, age) ==
    IF L.pstate[r] \notin HeldLive THEN L
    ELSE [L EXCEPT !.deadline[r] = Max(@, LeaseExtension - age),
                   !.pstate[r]   = IF @ = "notified" THEN "notified" ELSE "leased"]

(* Apply staged messages in arrival order (Ledger.register's loop). *)
RECURSIVE ApplyStaged(_, _, _)
ApplyStaged(L, r, msgs) ==
    IF msgs = <<>> THEN L
    ELSE LET m  == Head(msgs)
             L1 == IF L.pstate[r] \notin Held THEN L                    \* freed meanwhile: stale
                   ELSE IF m.kind = "heartbeat" THEN Renew(Announce(L, r, m.exp), r, m.age)
                   ELSE Finish(L, r, m.kind, m.reader, m.exp)
         IN  ApplyStaged(L1, r, Tail(msgs))

-----------------------------------------------------------------------------
(* Transitions on the record. *)

(* mirrors kvproto.lifecycle.Ledger.register (rows REGISTER/fresh, REGISTER/group_transferred) *)
RegisterOp(L, r) ==
    LET L0 == [L EXCEPT !.stagedQ = Remove(@, r), !.staged[r] = <<>>, !.stagedAge[r] = 0]
        msgs == L.staged[r]
    IN  IF GroupOf[r] # NoGroup /\ GroupOf[r] \in L.groupsDone
        THEN \* hold then free in one step: the pool is unchanged, r is freed (reason sibling)
             [L0 EXCEPT !.pstate[r] = "freed", !.nfree[r] = @ + 1]
        ELSE LET L1 == [L0 EXCEPT !.pstate[r] = "registered",
                                  !.deadline[r] = InitialLease,
                                  !.expected[r] = RegExpected[r],
                                  !.finished[r] = {}, !.released[r] = FALSE, !.reports[r] = 0,
                                  !.rc = [b \in Blocks |-> IF b \in BlocksOf[r] THEN @[b] + 1 ELSE @[b]]]
             IN  ApplyStaged(L1, r, msgs)

(* mirrors kvproto.lifecycle.Ledger.done *)
DoneOp(L, r, d, e) ==
    IF L.pstate[r] \in Held THEN Finish(L, r, "done", d, e) ELSE NotLive(L, r, "done", d, e)

(* mirrors kvproto.lifecycle.Ledger.release (one handle of the batch) *)
ReleaseOp(L, r, d, e) ==
    IF L.pstate[r] \in Held THEN Finish(L, r, "release", d, e) ELSE NotLive(L, r, "release", d, e)

(* mirrors kvproto.lifecycle.Ledger.heartbeat (one handle of the batch):
   rows HEARTBEAT/renew (registered,leased -> leased; notified stays), HEARTBEAT/refuse
   (aborted), late/stale (expired/freed), early (stage). *)
HeartbeatOp(L, r, d, e) ==
    CASE L.pstate[r] \in HeldLive ->
            LET L1 == Announce(L, r, e)
            IN  [L1 EXCEPT !.deadline[r] = Max(@, LeaseExtension),
                           !.pstate[r]   = IF @ = "notified" THEN "notified" ELSE "leased"]
      [] L.pstate[r] = "aborted" -> L
      [] OTHER -> NotLive(L, r, "heartbeat", d, e)

(* Ledger.heartbeat over a whole batch S of handles (handles are independent). *)
RECURSIVE HeartbeatBatchOp(_, _, _, _)
HeartbeatBatchOp(L, S, d, e) ==
    IF S = {} THEN L
    ELSE LET r == CHOOSE q \in S : TRUE
         IN  HeartbeatBatchOp(HeartbeatOp(L, r, d, e), S \ {r}, d, e)

(* What the Ack says about r: refused when aborted/expired/freed; an early (staged) or
   dropped-early heartbeat is NOT refused (Python leaves it out of `refused`). *)
HeartbeatRefused(L, r) == L.pstate[r] \in {"aborted", "expired", "freed"}

(* mirrors kvproto.lifecycle.Ledger.abort (rows ABORT/hold, ABORT/again, ABORT/unknown) *)
AbortOp(L, r) ==
    IF L.pstate[r] \in HeldLive
    THEN IF BugAbortFreesNow
         THEN Free(L, r, "freed")                                   \* BUG (b)
         ELSE [L EXCEPT !.pstate[r] = "aborted", !.deadline[r] = Min(@, AbortGrace)]
    ELSE L

(* A staged message one time unit older (only heartbeats keep an age). *)
AgeMsg(m) == [m EXCEPT !.age = IF m.kind = "heartbeat" THEN @ + 1 ELSE 0]

(* The held requests whose deadline has passed once one more unit passes: the ones a
   tick may expire. *)
DueAtTick(L) == {q \in Requests : L.pstate[q] \in Held /\ L.deadline[q] <= 1}

(* mirrors kvproto.lifecycle.Ledger.tick(now + 1): one time unit passes; deadlines
   <= now expire (TICK/deadline_passed: held live -> expired, aborted -> freed), except
   the requests in Late: a tick that ran out of its work budget (Config.max_tick_work)
   leaves them for a later tick. A late request stays held with deadline 0 (the Python
   deadline lies in the past): it can still be renewed, finished or released, and any
   later tick may expire it. An expiry may be late, never early. Staged entries
   reaching MaxStagedAge are dropped (never late: bounded by MaxStaged). *)
TickLagOp(L, Late) ==
    LET L1 == [L EXCEPT !.deadline = [q \in Requests |->
                                       IF L.pstate[q] \in Held
                                       THEN Max(L.deadline[q] - 1, 0) ELSE 0]]
        Exp == {q \in Requests : L1.pstate[q] \in HeldLive /\ L1.deadline[q] <= 0} \ Late
        Abo == {q \in Requests : L1.pstate[q] = "aborted" /\ L1.deadline[q] <= 0} \ Late
        L2 == FreeSet(FreeSet(L1, Exp, "expired"), Abo, "freed")
        Old == {q \in Range(L2.stagedQ) : L2.stagedAge[q] + 1 >= MaxStagedAge}
    IN  [L2 EXCEPT
           !.stagedQ   = SelectSeq(@, LAMBDA q : q \notin Old),
           !.stagedAge = [q \in Requests |-> IF q \in Range(L2.stagedQ) \ Old THEN L2.stagedAge[q] + 1 ELSE 0],
           !.staged    = [q \in Requests |->
                            IF q \in Range(L2.stagedQ) \ Old
                            THEN [i \in DOMAIN L2.staged[q] |-> AgeMsg(L2.staged[q][i])]
                            ELSE <<>>]]

(* The prompt tick: every due request expires (an unbounded budget). *)
TickOp(L) == TickLagOp(L, {})

-----------------------------------------------------------------------------
(* Actions over abstract inputs. Each names the Python method it mirrors. *)

\* mirrors kvproto.lifecycle.Ledger.register
Register(r) == pstate[r] = "unregistered" /\ Write(RegisterOp(Cur, r))
\* mirrors kvproto.lifecycle.Ledger.done
Done(r, d, e) == Write(DoneOp(Cur, r, d, e))
\* mirrors kvproto.lifecycle.Ledger.heartbeat
Heartbeat(r, d, e) == Write(HeartbeatOp(Cur, r, d, e))
\* mirrors kvproto.lifecycle.Ledger.release
Release(r, d, e) == Write(ReleaseOp(Cur, r, d, e))
\* mirrors kvproto.lifecycle.Ledger.abort
Abort(r) == Write(AbortOp(Cur, r))
\* mirrors kvproto.lifecycle.Ledger.tick
Tick == Write(TickOp(Cur))
\* mirrors kvproto.lifecycle.Ledger.tick when its work budget runs out: Late is left due
TickLag(Late) == Write(TickLagOp(Cur, Late))

-----------------------------------------------------------------------------
LedgerInit ==
    /\ pstate = [r \in Requests |-> "unregistered"]
    /\ expected = [r \in Requests |-> 0]
    /\ finished = [r \in Requests |-> {}]
    /\ released = [r \in Requests |-> FALSE]
    /\ deadline = [r \in Requests |-> 0]
    /\ reports = [r \in Requests |-> 0]
    /\ rc = [b \in Blocks |-> 0]
    /\ stagedQ = <<>>
    /\ staged = [r \in Requests |-> <<>>]
    /\ stagedAge = [r \in Requests |-> 0]
    /\ groupsDone = {}
    /\ nfree = [r \in Requests |-> 0]

(* The ledger alone, driven by any input (for the Python-vs-TLC graph equality).
   Expected-reader announcements range over 0..LedgerMaxExpected. *)
CONSTANT LedgerMaxExpected
LedgerNext ==
    \/ \E r \in Requests : Register(r) \/ Abort(r)
    \/ \E r \in Requests, d \in Readers, e \in 0..LedgerMaxExpected :
          Done(r, d, e) \/ Heartbeat(r, d, e) \/ Release(r, d, e)
    \/ Tick
LedgerSpec == LedgerInit /\ [][LedgerNext]_ledgerVars

-----------------------------------------------------------------------------
(* Invariants of the ledger (KVLifecycle adds the ones that need D and time). *)

LedgerTypeOK ==
    /\ pstate \in [Requests -> PStates]
    /\ expected \in [Requests -> Nat]
    /\ finished \in [Requests -> SUBSET Readers]
    /\ released \in [Requests -> BOOLEAN]
    /\ deadline \in [Requests -> Int]
    /\ reports \in [Requests -> Nat]
    /\ rc \in [Blocks -> Int]
    /\ Range(stagedQ) \subseteq Requests /\ Len(stagedQ) = Cardinality(Range(stagedQ))
    /\ staged \in [Requests -> Seq([kind : MsgKinds, reader : Readers, exp : Nat, age : Nat])]
    /\ stagedAge \in [Requests -> Nat]
    /\ groupsDone \subseteq Groups
    /\ nfree \in [Requests -> Nat]
    /\ \A r \in Requests : pstate[r] \notin Held =>
          expected[r] = 0 /\ finished[r] = {} /\ ~released[r] /\ deadline[r] = 0

(* No reference count below zero, and each request freed at most once. *)
NoDoubleFree ==
    /\ \A b \in Blocks : rc[b] >= 0
    /\ \A r \in Requests : nfree[r] <= 1

(* held + free = capacity, and every count equals the number of holders. *)
Holders(b) == Cardinality({r \in Requests : pstate[r] \in Held /\ b \in BlocksOf[r]})
HeldCount  == Cardinality({b \in Blocks : rc[b] > 0})
FreeCount  == Cardinality({b \in Blocks : rc[b] = 0})
Conservation ==
    /\ HeldCount + FreeCount = Cardinality(Blocks)
    /\ \A b \in Blocks : rc[b] = Holders(b)

(* Staging stays within its caps, and only unregistered requests are staged. *)
StagingBounded ==
    /\ Len(stagedQ) <= MaxStaged
    /\ \A r \in Requests : Len(staged[r]) <= MaxStagedMsgs
    /\ \A r \in Range(stagedQ) : pstate[r] = "unregistered"
    /\ \A r \in Requests : r \notin Range(stagedQ) => staged[r] = <<>>

(* A message about a terminal (expired or freed) request changes nothing. *)
StaleIsHarmlessLedger ==
    [][\A r \in Requests, d \in Readers, e \in 0..LedgerMaxExpected :
         pstate[r] \in Terminal =>
            /\ DoneOp(Cur, r, d, e) = Cur
            /\ ReleaseOp(Cur, r, d, e) = Cur
            /\ HeartbeatOp(Cur, r, d, e) = Cur
            /\ AbortOp(Cur, r) = Cur]_ledgerVars
=============================================================================
