--------------------------- MODULE TraceConsumer ---------------------------
(***************************************************************************)
(* Trace validation of one D rank's journal against KVConsumer.           *)
(* `kvproto validate` (kvproto/verify/dtrace.py) turns a D journal into   *)
(* the constant Trace and instantiates this module once per segment; TLC  *)
(* walks it: every step moves the clock (KVConsumer's Shift), applies     *)
(* KVConsumer's own operator for the event (AdmitOp, HandshakeOkOp,       *)
(* HandshakeFailedOp, ScheduleOp, ReadOkOp, ReadFailedOp, DAbortOp,       *)
(* DAckOp, PeerLostOp, DTickLagOp; a "reject", bad bytes the port refused,*)
(* is a stuttering step: NoOp, only the clock moves) and checks that the  *)
(* effects the implementation recorded are exactly the spec's: the same   *)
(* effect records, Finished states equal to the spec's dst, and heartbeat *)
(* batches the spec allows (HbBatchesOK) exactly when the heartbeat is    *)
(* due. A tick may leave lost leases for later (DTickLagOp: its work      *)
(* budget ran out), never fail more than TickWork of them, never fail one *)
(* early. The first step where they differ is printed with PrintT.        *)
(*                                                                         *)
(* Mapping (journal -> constants), done by kvproto/verify/dtrace.py:      *)
(*  - each admission (a request id D created a machine for) -> request    *)
(*    "q<k>"; events and effects naming a request id or a handle name the *)
(*    admission live under it; one that names none names "-", a request   *)
(*    never admitted (every event on it is a no-op);                      *)
(*  - GroupOf/TermOf/ExpOf from the admission's transfer params (term in  *)
(*    ms); one P engine per journal;                                      *)
(*  - times: the journal's own integers, milliseconds (one time unit is   *)
(*    one ms, as in the Python Consumer); each step carries dt, the ms    *)
(*    since the previous event, and an admit whose time lies behind D's   *)
(*    clock carries late (Consumer.admit keeps its own, earlier time).    *)
(*                                                                         *)
(* SEGMENTS, as in TraceLedger: a segment names the requests live at its  *)
(* start, those it admits and the group owners they may meet; it starts   *)
(* from the journal replayed through the Python Consumer (StartC: the     *)
(* abstraction function of KVConsumer's header, restricted to Requests)   *)
(* and must end in the replayed state (EndC), so the segments chain into  *)
(* one behaviour of the spec.                                              *)
(***************************************************************************)
EXTENDS KVConsumer, Sequences, TLC

CONSTANTS
    Trace,     \* the steps, a sequence of records (fields below)
    TraceId,   \* this trace's number in the batch (for the report)
    StartC,    \* the machine record (KVConsumer's variables) at the trace's start
    EndC,      \* the machine record the implementation reached at the trace's end (eff {})
    TickWork   \* Config.max_tick_work: lease-heap entries one tick may process

(* A step:
   [type |-> "admit"|"readmit"|"handshake_ok"|"handshake_failed"|"schedule"|"read_ok"|"read_failed"
             |"abort"|"ack"|"peer_lost"|"tick"|"reject"|"claim"|"never",
    dt   |-> time units since the previous event, late |-> (admit) units behind the clock,
    r    |-> request, flag |-> notification attached (read_ok) / fenced (read_failed)
            / granted (claim: claim_granted or claim_refused),
    why  |-> handshake_failed's reason,
    seq, term, ref, pen |-> (ack) sequence number, granted term, refused and pending
            requests,
    eff  |-> the recorded effects as KVConsumer's effect records,
    fin  |-> {[r, st]}: the recorded Finished effects' requests and states,
    hb   |-> {[seq, rs, e]}: the recorded SendHeartbeat effects]                    *)

VARIABLE tst   \* [tid, i (steps done), bad (failing step or 0), why, C (the machine)]

Start == [tid |-> TraceId, i |-> 0, bad |-> 0, why |-> "", C |-> StartC]

Batches(ev) == {[seq |-> b.seq, rs |-> b.rs] : b \in ev.hb}

(* The requests a recorded tick failed for their lease. *)
LostRs(ev) == {f.r : f \in {f \in ev.eff : f.k = "finish" /\ f.why = "lease_lost"}}

(* The requests a recorded tick failed for an overdue READ. *)
TimedOutRs(ev) == {f.r : f \in {f \in ev.eff : f.k = "finish" /\ f.why = "read_timeout"}}

(* The lost leases and overdue READs a tick left for later (its work budget ran out):
   those of the spec's LeaseLost and Overdue the journal does not fail at this tick. A
   lease_lost finish of a request whose lease still covers a READ, or a read_timeout of a
   READ not yet overdue, is an effect the spec does not have (never early). *)
Late(ev, C0) == IF ev.type = "tick"
                THEN (LeaseLost(C0) \ LostRs(ev)) \cup (Overdue(C0) \ TimedOutRs(ev))
                ELSE {}

(* The spec's machine after the event (the clock already moved to the event's time). *)
Successor(ev, C0) ==
    CASE ev.type = "admit" -> AdmitOp(C0, ev.r, ev.late)
      [] ev.type = "handshake_ok" -> HandshakeOkOp(C0)
      [] ev.type = "handshake_failed" -> HandshakeFailedOp(C0, ev.why)
      [] ev.type = "schedule" -> ScheduleOp(C0, ev.r)
      [] ev.type = "read_ok" -> ReadOkOp(C0, ev.r, ev.flag)
      [] ev.type = "read_failed" -> ReadFailedOp(C0, ev.r, ev.flag)
      [] ev.type = "abort" -> DAbortOp(C0, ev.r)
      [] ev.type = "ack" -> DAckOp(C0, {h \in C0.hbs : h.seq = ev.seq}, ev.term, ev.ref, ev.pen)
      [] ev.type = "peer_lost" -> PeerLostOp(C0)
      [] ev.type = "tick" -> DTickLagOp(C0, Late(ev, C0), Batches(ev))
      [] ev.type = "reject" -> NoOp(C0)
      [] ev.type = "readmit" -> ReadmitOp(C0, ev.r)
      [] ev.type = "claim" -> ClaimResultOp(C0, ev.r, ev.flag)
      [] ev.type = "never" -> NeverOp(C0, ev.r)

(* "" when the recorded effects are the spec's, else why not. *)
Check(ev, C0, C1) ==
    LET CL == TickLossLagOp(C0, Late(ev, C0)) IN
    CASE ev.type = "tick" /\ Cardinality(LostRs(ev)) > TickWork
            -> "a tick failed more leases than its work budget (max_tick_work)"
      [] ev.type = "tick" /\ CL.hbWait > 0 /\ ev.hb # {}
            -> "a heartbeat before the heartbeat interval has passed"
      [] ev.type = "tick" /\ CL.hbWait = 0 /\ ~HbBatchesOK(CL, Batches(ev))
            -> "heartbeat batches differ from the spec's (requests named, or sequence numbers)"
      [] ev.type = "tick" /\ \E b \in ev.hb : \E q \in b.rs : ExpOf[q] # b.e
            -> "a heartbeat's expected-reader count differs from its requests'"
      [] ev.type # "tick" /\ ev.hb # {} -> "a heartbeat outside a tick"
      [] ev.eff \ C1.eff # {} -> "an effect the spec does not have in this step"
      [] C1.eff \ ev.eff # {} -> "the spec has an effect here that the journal does not"
      [] \E f \in ev.fin : C1.dst[f.r] # f.st -> "finished state differs from the spec's"
      [] OTHER -> ""

Step(S) ==
    LET ev == Trace[S.i + 1]
        C0 == Shift(S.C, ev.dt)
        C1 == Successor(ev, C0)
        why == Check(ev, C0, C1)
    IN  IF why # ""
        THEN [S EXCEPT !.bad = S.i + 1, !.why = why]
        ELSE [S EXCEPT !.i = S.i + 1, !.C = C1]

TInit == tst = Start

(* Terminal states print the verdict and have no successor (TLC runs with -deadlock). *)
TNext ==
    \/ /\ tst.bad = 0 /\ tst.i < Len(Trace)
       /\ tst' = Step(tst)
    \/ /\ tst.bad # 0
       /\ PrintT(<<"REJECT", TraceId, tst.bad, tst.why>>)
       /\ FALSE
    \/ /\ tst.bad = 0 /\ tst.i = Len(Trace) /\ Len(Trace) > 0
       /\ [tst.C EXCEPT !.eff = {}] # EndC
       /\ tst' = [tst EXCEPT !.bad = Len(Trace),
                             !.why = "the spec's machine after this step differs from the implementation's"]
    \/ /\ tst.bad = 0 /\ tst.i = Len(Trace)
       /\ ([tst.C EXCEPT !.eff = {}] = EndC \/ Len(Trace) = 0)
       /\ PrintT(<<"ACCEPT", TraceId, tst.i>>)
       /\ FALSE
=============================================================================
