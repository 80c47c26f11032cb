---------------------------- MODULE TraceLedger ----------------------------
(***************************************************************************)
(* Trace validation of a recorded P journal against KVLedger (issue 4).    *)
(* `kvproto validate` (kvproto/verify/validate.py) turns a journal into the       *)
(* constant Trace and instantiates this module once per journal; TLC then  *)
(* walks the trace: every step applies KVLedger's own transition operators *)
(* (RegisterOp, DoneOp, ReleaseOp, HeartbeatOp, AbortOp, TickOp) to the    *)
(* ledger record and checks that the effects the implementation recorded  *)
(* (frees, reclaimed blocks, heartbeat acks, rejections) are exactly the   *)
(* ones the spec's step implies. The first step where they differ is the   *)
(* first step the spec does not allow; it is printed with PrintT.          *)
(*                                                                         *)
(* Mapping (journal -> constants), done by kvproto/verify/validate.py:            *)
(*  - handles -> request names "h<handle>"; readers -> their names;        *)
(*    blocks -> the same ints; groups -> their names, None -> NoGroup;     *)
(*  - BlocksOf/GroupOf/RegExpected: from the handle's first valid register;*)
(*  - times: the journal's own integers, milliseconds (one time unit is    *)
(*    one ms, as in the Python ledger); event time = max(previous, journal *)
(*    time) (the ledger clamps clock regressions); each step carries dt,   *)
(*    the milliseconds since the previous event;                           *)
(*  - `reject` events (malformed input dropped by the adapter) stutter.    *)
(*                                                                         *)
(* WHAT THIS MODULE ADDS TO KVLedger: the clock moving without a sweep.    *)
(* KVLedger couples time to Tick (one unit, then expire); the Python       *)
(* ledger takes the time of every event, so a heartbeat arriving between   *)
(* two ticks renews to (its time + extension). Shift(L, k) is "k units     *)
(* pass, nothing is swept": held deadlines drop by k, staged heartbeats    *)
(* and staging entries age by k. A tick after dt units is                  *)
(* TickOp(Shift(L, dt - 1)): TickOp is KVLedger's own (the last unit, then *)
(* expiry and the staging sweep); dt = 0 (a tick at the time of the        *)
(* previous event) is Shift by -1 then TickOp, i.e. a sweep at that time.  *)
(***************************************************************************)
EXTENDS KVLedger, TLC

CONSTANTS
    Trace,     \* the steps, a sequence of records (fields below)
    TraceId,   \* this trace's number in the batch (for the report)
    InitL,     \* the ledger record (KVLedger's variables) at the trace's start
    InitRid,   \* [Requests -> request id] of the live requests at the start ("" else)
    EndL       \* the ledger record the implementation reached at the trace's end

(* SEGMENTS. A journal is validated in segments of a few hundred steps, each one
   instance of this module over only the requests the segment can touch: those live or
   staged at its start and those its events name (a step costs O(those), so TLC's time
   grows linearly with the journal). kvproto/verify/validate.py replays the journal through
   the Python ledger to get InitL (the abstraction function of KVLedger's header,
   restricted to Requests; time relative to the previous event) and EndL (the same at
   the segment's end). A segment is allowed when every step is and the spec's ledger
   after its last step is EndL, which is the next segment's InitL: the segments chain
   into one behaviour of the spec. Requests outside a segment are terminal or unknown
   and untouched by it, so leaving them out changes no step. *)

(* A step:
   [type      |-> "register"|"done"|"release"|"heartbeat"|"abort"|"tick"|"stutter",
    dt        |-> time units since the previous event,
    r         |-> request (register, done), rs |-> <<requests>> (release, heartbeat),
    d         |-> reader, e |-> expected readers announced, rid |-> request id,
    valid     |-> FALSE when the register's inputs are malformed (bad block ids...),
    frees     |-> <<[r, st, reason, blocks]>>  the Free effects (st: terminal state
                  implied by the reason: "expired" for expired, else "freed"),
    reclaimed |-> the union of the Free effects' reclaimed blocks,
    rejected  |-> <<reasons>> of Rejected effects,
    acks      |-> <<[refused, pending]>> of Ack effects]                            *)

VARIABLE tst   \* [tid, i (steps done), bad (failing step or 0), why, L (ledger), ridOf]

Start == [tid |-> TraceId, i |-> 0, bad |-> 0, why |-> "", L |-> InitL, ridOf |-> InitRid]

(* k time units pass; nothing is swept (see the header). *)
Shift(L, k) ==
    IF k = 0 THEN L
    ELSE [L EXCEPT
          !.deadline  = [q \in Requests |-> IF L.pstate[q] \in Held THEN L.deadline[q] - k
                                            ELSE L.deadline[q]],
          !.stagedAge = [q \in Requests |-> IF q \in Range(L.stagedQ)
                                            THEN L.stagedAge[q] + k ELSE L.stagedAge[q]],
          !.staged    = [q \in Requests |->
                           [j \in DOMAIN L.staged[q] |->
                              IF L.staged[q][j].kind = "heartbeat"
                              THEN [L.staged[q][j] EXCEPT !.age = @ + k]
                              ELSE L.staged[q][j]]]]

(* The live request holding request id `rid`, or "" (Ledger._by_rid). *)
LiveByRid(S, rid) ==
    LET Q == {q \in Requests : S.L.pstate[q] \in Held /\ S.ridOf[q] = rid}
    IN  IF Q = {} THEN "" ELSE CHOOSE q \in Q : TRUE

(* Register of a handle or request id already known: rejected, no change. *)
KnownRegister(S, ev) == S.L.pstate[ev.r] # "unregistered" \/ LiveByRid(S, ev.rid) # ""

RECURSIVE ReleaseFold(_, _, _, _)
ReleaseFold(L, rs, d, e) ==
    IF rs = <<>> THEN L ELSE ReleaseFold(ReleaseOp(L, Head(rs), d, e), Tail(rs), d, e)

(* Heartbeat batch: the ledger after it, and what the Ack must say. *)
RECURSIVE HbFold(_, _, _, _, _, _)
HbFold(L, rs, d, e, ref, pen) ==
    IF rs = <<>> THEN [L |-> L, refused |-> ref, pending |-> pen]
    ELSE LET r == Head(rs)
         IN  HbFold(HeartbeatOp(L, r, d, e), Tail(rs), d, e,
                    IF HeartbeatRefused(L, r) THEN ref \cup {r} ELSE ref,
                    IF L.pstate[r] = "unregistered" THEN pen \cup {r} ELSE pen)

FreeRs(ev) == {ev.frees[j].r : j \in DOMAIN ev.frees}

(* The spec's successor of the ledger for one step (after the clock moved). A tick may
   leave due requests for later (the ledger's work budget): those the journal does not
   free at this tick are the late ones (KVLedger's TickLagOp); a free of a request that
   is not due is still caught by Check. *)
Successor(S, ev, L0) ==
    CASE ev.type = "register" ->
            IF ~ev.valid \/ KnownRegister(S, ev) THEN L0 ELSE RegisterOp(L0, ev.r)
      [] ev.type = "done" -> DoneOp(L0, ev.r, ev.d, ev.e)
      [] ev.type = "release" -> ReleaseFold(L0, ev.rs, ev.d, ev.e)
      [] ev.type = "heartbeat" -> HbFold(L0, ev.rs, ev.d, ev.e, {}, {}).L
      [] ev.type = "abort" ->
            LET q == LiveByRid(S, ev.rid) IN IF q = "" THEN L0 ELSE AbortOp(L0, q)
      [] ev.type = "tick" -> TickLagOp(L0, DueAtTick(L0) \ FreeRs(ev))
      [] ev.type = "stutter" -> L0

(* "" when the recorded effects are the spec's, else why not. *)
Check(S, ev, L0, L1) ==
    LET F == {q \in Requests : L1.nfree[q] > L0.nfree[q]}
        Rec == {b \in UNION {BlocksOf[q] : q \in F} : L1.rc[b] = 0}
        ExpRej == IF ev.type = "register" /\ ~ev.valid THEN <<"invalid_register">>
                  ELSE IF ev.type = "register" /\ KnownRegister(S, ev) THEN <<"duplicate_register">>
                  ELSE <<>>
        Hb == HbFold(L0, ev.rs, ev.d, ev.e, {}, {})
    IN
    CASE ev.type = "stutter" -> ""
      [] Len(ev.frees) # Cardinality(FreeRs(ev)) -> "a request is freed twice in one step"
      [] FreeRs(ev) \ F # {} -> "free of a request the spec does not free in this step"
      [] F \ FreeRs(ev) # {} -> "the spec frees a request here but the journal has no free"
      [] \E j \in DOMAIN ev.frees : ev.frees[j].st # L1.pstate[ev.frees[j].r]
            -> "free reason does not match the spec's terminal state"
      [] \E j \in DOMAIN ev.frees : ev.frees[j].reason \in {"expired", "aborted"} /\ ev.type # "tick"
            -> "expiry/abort-deadline free outside a tick"
      [] \E j \in DOMAIN ev.frees : ev.frees[j].reason = "aborted" /\ L0.pstate[ev.frees[j].r] # "aborted"
            -> "abort-deadline free of a request that was not aborted"
      [] \E j \in DOMAIN ev.frees : ev.frees[j].blocks # BlocksOf[ev.frees[j].r]
            -> "freed blocks differ from the registered blocks"
      [] ev.reclaimed # Rec -> "reclaimed blocks differ from the spec's reference counts"
      [] ev.rejected # ExpRej -> "rejection differs from the spec (register guard)"
      [] ev.type = "heartbeat" /\ Len(ev.acks) # 1 -> "a heartbeat must be answered by one ack"
      [] ev.type # "heartbeat" /\ Len(ev.acks) # 0 -> "ack for something that is not a heartbeat"
      [] ev.type = "heartbeat" /\ ev.acks[1].refused # Hb.refused
            -> "ack refuses a different set of requests than the spec"
      [] ev.type = "heartbeat" /\ ev.acks[1].pending # Hb.pending
            -> "ack's pending (staged) set differs from the spec"
      [] OTHER -> ""

Step(S) ==
    LET ev == Trace[S.i + 1]
        L0 == IF ev.type = "tick" THEN Shift(S.L, ev.dt - 1) ELSE Shift(S.L, ev.dt)
        L1 == Successor(S, ev, L0)
        why == Check(S, ev, L0, L1)
        registered == ev.type = "register" /\ ev.valid /\ L0.pstate[ev.r] = "unregistered"
                      /\ L1.pstate[ev.r] # "unregistered"
    IN  IF why # ""
        THEN [S EXCEPT !.bad = S.i + 1, !.why = why]
        ELSE [S EXCEPT !.i = S.i + 1, !.L = L1,
                       !.ridOf = IF registered THEN [@ EXCEPT ![ev.r] = ev.rid] ELSE @]

TInit == tst = Start

(* Terminal states print the verdict and have no successor (TLC runs with -deadlock). *)
TNext ==
    \/ /\ tst.bad = 0 /\ tst.i < Len(Trace)
       /\ tst' = Step(tst)
    \/ /\ tst.bad # 0
       /\ PrintT(<<"REJECT", TraceId, tst.bad, tst.why>>)
       /\ FALSE
    \/ /\ tst.bad = 0 /\ tst.i = Len(Trace) /\ tst.L # EndL /\ Len(Trace) > 0
       /\ tst' = [tst EXCEPT !.bad = Len(Trace),
                             !.why = "the spec's ledger after this step differs from the implementation's"]
    \/ /\ tst.bad = 0 /\ tst.i = Len(Trace) /\ (tst.L = EndL \/ Len(Trace) = 0)
       /\ PrintT(<<"ACCEPT", TraceId, tst.i>>)
       /\ FALSE
=============================================================================
