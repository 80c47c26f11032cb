----------------------------- MODULE KVConsumer -----------------------------
(***************************************************************************)
(* One D rank's machine alone: kvproto.lifecycle.Consumer for one reader  *)
(* and one P engine, driven by any input. It is to D_TRANSITIONS what     *)
(* KVLedger is to P_TRANSITIONS: pure operators over a record of the      *)
(* machine's state (AdmitOp, ..., DTickOp), one per Python event, and     *)
(* actions over abstract inputs that apply them (Next). Two checks use it: *)
(*  - D state-graph equality (kvproto.verify.dconformance): TLC's graph   *)
(*    of a small model against a BFS of the real Consumer;                *)
(*  - trace validation of D journals (conformance/TraceConsumer.tla,      *)
(*    `kvproto validate`): a recorded journal walked through the same     *)
(*    operators.                                                          *)
(* NAMES agree with D_TRANSITIONS and KVLifecycle's D actions: Admit,     *)
(* HandshakeOk, HandshakeFailed, Schedule, ReadOk, ReadFailed, DAbort,    *)
(* ClaimGranted, ClaimRefused, Never,                                      *)
(* DAck (rows ACK/granted: renew; ACK/refused: release, disown,           *)
(* finish:revoked, or let a READ finish), PeerLost, and DTick, the whole  *)
(* Consumer.tick: rows D_TICK/lease_lost, the ack-silence check           *)
(* (PEER_LOST rows after peer_timeout, effect drop_peer) and the          *)
(* heartbeats D sends every HeartbeatInterval. DTickLagOp is the partial  *)
(* tick: its work budget (Config.max_tick_work) left some lost leases for *)
(* a later tick (a lease loss may be late, never early).                  *)
(*                                                                         *)
(* HEARTBEATS are state, not messages: hbs is the set of heartbeats sent  *)
(* and not yet acknowledged (Python's _Peer.outstanding), each a record   *)
(* [seq, rs (the requests it names), age (now - send time)]. A heartbeat  *)
(* leaves as the effect record [k |-> "heartbeat"]; the batches it was cut *)
(* into (one per expected-reader count, chunked to fit a wire message)    *)
(* are the new members of hbs. DAck(h, term, refused, pending) is P's     *)
(* ack of h: lease end := send time + term - drift (never lowered), as in *)
(* Consumer.ack. The graph model's acks grant LeaseExtension (what P      *)
(* grants) and number no heartbeat (seq 0); trace validation takes seq,   *)
(* term, refused and pending from the journal.                            *)
(*                                                                         *)
(* TIME is relative. The graph model's DTick is one time unit; the trace  *)
(* module moves the clock by any amount before every event (Shift).       *)
(*                                                                         *)
(* CAPS not reached: the group-owner memory is not evicted (ASSUME        *)
(* MAX_LANDED_GROUPS >= number of groups) and the peer table holds        *)
(* the one P engine (MAX_PEERS >= 1: no admit is refused peer_table_full). *)
(*                                                                         *)
(* ABSTRACTION (Python -> TLA+): dst[r] = Consumer.state(r), or the state *)
(* of its Finished effect once it left the machine; dlease[r] = lease end *)
(* - now while waiting, handshaking or claiming, else 0; abortPending[r] =*)
(* Consumer.abort_pending(r); owner[g] = Consumer.group_owner(engine, g)  *)
(* or "none"; peer = Consumer.peer_state(engine); hbs = {[seq, rs: the    *)
(* requests of its handles, age: now - sent_at] : the outstanding         *)
(* heartbeats of Consumer.peer(engine)}; hbWait = max(0,                  *)
(* Consumer.next_heartbeat_at - now); heard = min(now - last_heard,       *)
(* PeerTimeout + 1) while the peer is ready, else 0; eff =                *)
(* the effects of the last step as records (SendHeartbeat as one          *)
(* [k |-> "heartbeat"], DropPeer as [k |-> "drop_peer"]); mayRead (ghost) *)
(* = the requests admitted without a capability or granted by P.          *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS Requests, GroupOf, NoGroup, TermOf, ExpOf,
          CapOf,      \* CapOf[r]: r's params carry a capability (TransferParams.capability # "")
          MaxDelay, MaxReadTime, ClockDrift, HeartbeatInterval, LeaseExtension, PeerTimeout,
          ReadGrace,  \* Config.read_grace: a READ is overdue MaxReadTime + ReadGrace after its post
          DBug        \* "none"; a mutant's name (MC_dbug_*.cfg): see DBug below

(* BOUNDED READS and NO SECOND PULL (spec/PROTOCOL.md, "Bounded reads", "No second pull";
   kvproto/lifecycle/quarantine.py). rdl[r]: while reading, the READ's deadline - now
   (it is overdue once rdl[r] < 0; 0 otherwise). quar: requests that left D read_timeout
   whose READ the transport has not reported ended: their local blocks are quarantined.
   inflight (ghost): READs the transport has not reported ended; pulls (ghost): READs
   posted per request. The ended-load memory is dst[r] \in {"done", "failed"} (ASSUME
   quarantine.MAX_ENDED >= number of requests: never evicted in these models). *)
(* CLAIMS (spec/PROTOCOL.md, "D waits for P's grant"). A request whose params carry a
   capability presents it to P's gate (effect claim) and stays "claiming" until the gate
   answers: ClaimGranted (it may read), ClaimRefused (it fails, claim_refused), or Never
   (never_registered). mayRead (ghost): requests that may read, i.e. those without a
   capability, and those whose claim P granted. *)
VARIABLES dst, dlease, abortPending, owner, peer, hbs, hbWait, heard, eff,
          rdl, quar, inflight, pulls, mayRead
vars == <<dst, dlease, abortPending, owner, peer, hbs, hbWait, heard, eff,
          rdl, quar, inflight, pulls, mayRead>>

Groups == {GroupOf[r] : r \in Requests} \ {NoGroup}
DStates == {"new", "handshaking", "claiming", "waiting", "reading", "done", "failed"}
PeerStates == {"unknown", "handshaking", "ready"}   \* lifecycle.PEER_STATES
Active == {"handshaking", "claiming", "waiting", "reading"}
Idle == {"waiting", "handshaking", "claiming"}      \* a lease D still checks
Pulling == {"waiting", "reading"}                   \* named in heartbeats and acks
Max(a, b) == IF a >= b THEN a ELSE b
Min(a, b) == IF a <= b THEN a ELSE b

(* Consumer._read_fits, relative: now + max_read_time + clock_drift <= lease end *)
ReadFits(l) == MaxReadTime + ClockDrift <= l

E(k, r, why) == [k |-> k, r |-> r, why |-> why]
Finish(r, why) == E("finish", r, why)
Release(r) == E("release", r, "")
HbEffect == E("heartbeat", "", "")
DropPeer == E("drop_peer", "", "")

(* The machine's state as one record, and an action that makes a record the state. *)
Cur == [dst |-> dst, dlease |-> dlease, abortPending |-> abortPending, owner |-> owner,
        peer |-> peer, hbs |-> hbs, hbWait |-> hbWait, heard |-> heard, eff |-> eff,
        rdl |-> rdl, quar |-> quar, inflight |-> inflight, pulls |-> pulls,
        mayRead |-> mayRead]
Become(C) == /\ dst' = C.dst /\ dlease' = C.dlease /\ abortPending' = C.abortPending
             /\ owner' = C.owner /\ peer' = C.peer /\ hbs' = C.hbs /\ hbWait' = C.hbWait
             /\ heard' = C.heard /\ eff' = C.eff
             /\ rdl' = C.rdl /\ quar' = C.quar /\ inflight' = C.inflight /\ pulls' = C.pulls
             /\ mayRead' = C.mayRead

InitC == [dst |-> [r \in Requests |-> "new"], dlease |-> [r \in Requests |-> 0],
          abortPending |-> [r \in Requests |-> FALSE], owner |-> [g \in Groups |-> "none"],
          peer |-> "unknown", hbs |-> {}, hbWait |-> 0, heard |-> 0, eff |-> {},
          rdl |-> [r \in Requests |-> 0], quar |-> {}, inflight |-> {},
          pulls |-> [r \in Requests |-> 0], mayRead |-> {r \in Requests : ~CapOf[r]}]

(* An event that changes nothing (Python counts it: duplicate admit, schedule of a
   request not waiting, a READ result for one not reading, abort of an unknown one). *)
NoOp(C) == [C EXCEPT !.eff = {}]

(* The requests in S leave the machine: state d, per-request fields back to rest;
   with rel, the release and disown effects of the give-up rows (_RELEASE_FAIL). *)
Leave(C, S, d, why, rel) ==
    [C EXCEPT !.dst = [q \in Requests |-> IF q \in S THEN d ELSE C.dst[q]],
              !.dlease = [q \in Requests |-> IF q \in S THEN 0 ELSE C.dlease[q]],
              !.rdl = [q \in Requests |-> IF q \in S THEN 0 ELSE C.rdl[q]],
              !.abortPending = [q \in Requests |-> IF q \in S THEN FALSE ELSE C.abortPending[q]],
              !.owner = IF rel THEN [g \in Groups |-> IF C.owner[g] \in S THEN "none"
                                                     ELSE C.owner[g]]
                        ELSE C.owner,
              !.eff = {Finish(q, why) : q \in S} \cup
                      (IF rel THEN {Release(q) : q \in S} ELSE {})]

(* k time units pass and nothing else happens (the trace module's clock). *)
Shift(C, k) ==
    [C EXCEPT !.dlease = [q \in Requests |-> IF C.dst[q] \in Idle THEN C.dlease[q] - k
                                             ELSE C.dlease[q]],
              !.rdl = [q \in Requests |-> IF C.dst[q] = "reading" THEN C.rdl[q] - k
                                          ELSE C.rdl[q]],
              !.hbs = {[h EXCEPT !.age = h.age + k] : h \in C.hbs},
              !.hbWait = Max(0, C.hbWait - k),
              !.heard = IF C.peer = "ready" THEN Min(C.heard + k, PeerTimeout + 1) ELSE 0]

(* The state a request enters once P is known: claiming (effect claim) when its params
   carry a capability, else waiting. DBug "read_before_grant" is the mutant that skips
   the claim: it waits (and reads) without P's grant. *)
Claims(r) == CapOf[r] /\ DBug # "read_before_grant"
Known(r) == IF Claims(r) THEN "claiming" ELSE "waiting"

(* event admit: rows ADMIT/lease_short, peer_ready, claim, peer_unknown (start or join).
   late: how far the admit's own time lies behind D's clock (Consumer.admit keeps the
   earlier time: its read check uses it, and the lease runs from it). *)
AdmitOp(C, r, late) ==
    IF C.dst[r] # "new" THEN NoOp(C)
    ELSE LET l == TermOf[r] - MaxDelay IN
         IF ~ReadFits(l)
         THEN [C EXCEPT !.dst[r] = "failed", !.eff = {Release(r), Finish(r, "lease_short")}]
         ELSE IF C.peer = "ready"
         THEN [C EXCEPT !.dst[r] = Known(r), !.dlease[r] = l - late,
                        !.eff = IF Claims(r) THEN {E("claim", r, "")} ELSE {}]
         ELSE [C EXCEPT !.dst[r] = "handshaking", !.dlease[r] = l - late,
                        !.peer = "handshaking",
                        !.eff = IF C.peer = "unknown" THEN {E("handshake", "", "")} ELSE {}]

(* event handshake_ok: rows HANDSHAKE_OK/ok, claim; P is heard from now *)
HandshakeOkOp(C) ==
    [C EXCEPT !.peer = "ready", !.heard = 0,
              !.eff = {E("claim", q, "") : q \in {q \in Requests : C.dst[q] = "handshaking"
                                                               /\ Claims(q)}},
              !.dst = [q \in Requests |-> IF C.dst[q] = "handshaking" THEN Known(q)
                                          ELSE C.dst[q]]]

(* events claim_granted, claim_refused: rows CLAIM_GRANTED/granted (the request may
   read), CLAIM_REFUSED/refused (finish claim_refused; no release: the handle is not
   this consumer's). An answer for a request not claiming changes nothing. *)
ClaimResultOp(C, r, ok) ==
    IF C.dst[r] # "claiming" THEN NoOp(C)
    ELSE IF ok THEN [C EXCEPT !.dst[r] = "waiting", !.mayRead = @ \cup {r}, !.eff = {}]
    ELSE Leave(C, {r}, "failed", "claim_refused", FALSE)

(* event never: rows NEVER/idle (finish never_registered; no release: P holds nothing),
   NEVER/in_flight (the READ reports its own end). *)
NeverOp(C, r) ==
    IF C.dst[r] \in Idle THEN Leave(C, {r}, "failed", "never_registered", FALSE)
    ELSE NoOp(C)

(* event handshake_failed: row HANDSHAKE_FAILED/failed (no release: P expires);
   the finish reason is the event's *)
HandshakeFailedOp(C, why) ==
    [Leave(C, {q \in Requests : C.dst[q] = "handshaking"}, "failed", why, FALSE)
        EXCEPT !.peer = "unknown", !.heard = 0]

(* event schedule: rows SCHEDULE/sibling_in_flight, sibling_local, lease_short,
   lease_covers_read *)
ScheduleOp(C, r) ==
    IF C.dst[r] # "waiting" THEN NoOp(C)
    ELSE LET g == GroupOf[r]
             o == IF g # NoGroup THEN C.owner[g] ELSE "none"
         IN  IF o \notin {"none", r} /\ C.dst[o] \in Active
             THEN NoOp(C)
             ELSE IF o \notin {"none", r}
             THEN [Leave(C, {r}, "done", "sibling_local", FALSE)
                      EXCEPT !.eff = @ \cup {Release(r)}]
             ELSE IF ~ReadFits(C.dlease[r])
             THEN Leave(C, {r}, "failed", "lease_short", TRUE)
             ELSE [C EXCEPT !.dst[r] = "reading", !.dlease[r] = 0,
                            !.rdl[r] = MaxReadTime + ReadGrace,
                            !.inflight = @ \cup {r}, !.pulls[r] = @ + 1,
                            !.owner = IF g # NoGroup THEN [C.owner EXCEPT ![g] = r]
                                      ELSE C.owner,
                            !.eff = {E("read", r, "")}]

(* A READ result for a request no longer reading: the transport reported the end of a
   quarantined READ (effect unquarantine: its local blocks may go back), else nothing. *)
ReadEndOp(C, r) ==
    IF r \in C.quar
    THEN [C EXCEPT !.quar = @ \ {r}, !.inflight = @ \ {r}, !.eff = {E("unquarantine", r, "")}]
    ELSE NoOp(C)

(* event read_ok: rows READ_OK/ok, abort_pending (done sent unless it rode on the
   READ; no disown: P heard done) *)
ReadOkOp(C, r, attached) ==
    IF C.dst[r] # "reading" THEN ReadEndOp(C, r)
    ELSE LET L == Leave(C, {r}, IF C.abortPending[r] THEN "failed" ELSE "done",
                        IF C.abortPending[r] THEN "aborted" ELSE "pulled", FALSE)
         IN  [L EXCEPT !.eff = @ \cup (IF attached THEN {} ELSE {E("done", r, "")}),
                       !.inflight = @ \ {r}]

(* event read_failed: rows READ_FAILED/fenced, error. fenced is also the outcome of a  *)
(* READ whose stamps matched but a block checksum did not (Config.checksums; Python     *)
(* read_result(corrupt=TRUE)): the data is not modelled, so no action of its own.      *)
ReadFailedOp(C, r, fenced) ==
    IF C.dst[r] # "reading" THEN ReadEndOp(C, r)
    ELSE [Leave(C, {r}, "failed", IF fenced THEN "fenced" ELSE "transfer_error", TRUE)
             EXCEPT !.inflight = @ \ {r}]

(* A second load of a request that finished on D (same engine, epoch and handle): refused
   before the table (second_pull, recomputed locally; nothing changes). DBug
   "second_pull" is the mutant that forgets ended loads: it admits the load again. *)
ReadmitOp(C, r) ==
    IF C.dst[r] \notin {"done", "failed"} THEN NoOp(C)
    ELSE IF DBug = "second_pull"
    THEN [C EXCEPT !.dst[r] = Known(r), !.dlease[r] = TermOf[r] - MaxDelay,
                   !.abortPending[r] = FALSE,
                   !.eff = IF Claims(r) THEN {E("claim", r, "")} ELSE {}]
    ELSE [C EXCEPT !.eff = {Finish(r, "second_pull")}]

(* event abort (D): rows D_ABORT/idle, in_flight *)
DAbortOp(C, r) ==
    IF C.dst[r] \notin Active THEN NoOp(C)
    ELSE IF C.dst[r] = "reading"
    THEN [C EXCEPT !.abortPending[r] = TRUE, !.eff = {}]
    ELSE Leave(C, {r}, "failed", "aborted", TRUE)

(* event ack: P's answer to the heartbeats H (a set of at most one member of hbs; {}
   when the ack's seq is not outstanding: only "heard" changes). Rows ACK/granted
   (renew: lease end := send time + term - drift, never lowered), ACK/refused (waiting:
   release, disown, finish:revoked; reading: let the READ finish). Requests in pending
   (P had not registered them) keep their estimate. *)
DAckOp(C, H, term, refused, pending) ==
    LET C1 == [C EXCEPT !.heard = 0, !.eff = {}]
        named == UNION {h.rs : h \in H}
        live == {q \in named : C.dst[q] \in Pulling /\ q \notin pending}
        revoked == {q \in live : q \in refused /\ C.dst[q] = "waiting"}
        x == CHOOSE v \in {term - ClockDrift - h.age : h \in H} : TRUE
        granted == {q \in live \ refused : C.dst[q] = "waiting"}
    IN  IF H = {} THEN C1
        ELSE LET C2 == Leave([C1 EXCEPT !.hbs = C.hbs \ H], revoked, "failed", "revoked", TRUE)
             IN  [C2 EXCEPT !.dlease = [q \in Requests |-> IF q \in granted
                                                          THEN Max(C.dlease[q], x)
                                                          ELSE C2.dlease[q]]]

(* event peer_lost: rows PEER_LOST/lost (no release), in_flight; the heartbeats
   awaiting an ack are forgotten *)
PeerLostOp(C) ==
    [Leave(C, {q \in Requests : C.dst[q] \in Idle}, "failed", "peer_lost", FALSE)
        EXCEPT !.peer = "unknown", !.heard = 0, !.hbs = {}]

(* The requests D's heartbeat names: waiting (queued ones too) and reading, of a
   ready peer. *)
Pull(C) == IF C.peer = "ready" THEN {q \in Requests : C.dst[q] \in Pulling} ELSE {}

(* The heartbeat batches the graph model sends: one per expected-reader count. *)
HbCanon(C) == {[seq |-> 0, rs |-> {q \in Pull(C) : ExpOf[q] = e}] : e \in {ExpOf[q] : q \in Pull(C)}}

(* Batches Consumer.tick may send for C (with its chunking): non-empty, disjoint, one
   expected count each, covering Pull(C), under sequence numbers not outstanding. *)
HbBatchesOK(C, B) ==
    /\ UNION {b.rs : b \in B} = Pull(C)
    /\ \A b \in B : b.rs # {} /\ \A q, q2 \in b.rs : ExpOf[q] = ExpOf[q2]
    /\ \A b, b2 \in B : b # b2 => b.rs \cap b2.rs = {} /\ b.seq # b2.seq
    /\ \A b \in B : \A h \in C.hbs : h.seq # b.seq

(* The idle requests whose lease can no longer cover a READ: the ones a tick fails. *)
LeaseLost(C) == {q \in Requests : C.dst[q] \in Idle /\ ~ReadFits(C.dlease[q])}

(* The READs past their deadline: row D_TICK/read_overdue (disown, quarantine, finish:
   read_timeout; no release: the READ may still touch P's blocks). DBug "early_release"
   is the mutant that returns the local blocks at once (no quarantine). *)
Overdue(C) == {q \in Requests : C.dst[q] = "reading" /\ C.rdl[q] < 0}
TimeoutOp(C, S) ==
    [Leave(C, S, "failed", "read_timeout", FALSE)
        EXCEPT !.owner = [g \in Groups |-> IF C.owner[g] \in S THEN "none" ELSE C.owner[g]],
               !.quar = IF DBug = "early_release" THEN @ ELSE @ \cup S,
               !.eff = @ \cup (IF DBug = "early_release" THEN {}
                               ELSE {E("quarantine", q, "") : q \in S})]

(* event tick, first part: rows D_TICK/lease_lost (release, disown) for every request of
   LeaseLost(C) except those in Late: a tick that ran out of its work budget
   (Config.max_tick_work, Consumer.sweep_leases) leaves them for a later tick. A late
   request stays idle with its lease estimate: a heartbeat still names it, an ack may
   renew it, a schedule fails it (lease_short), a later tick fails it. A lease loss may
   be late, never early. Then the ack-silence check: a ready peer heard from more than
   PeerTimeout ago, with a heartbeat older than that still unanswered, is lost (PEER_LOST
   rows, effect drop_peer; late requests included). *)
TickLossLagOp(C, Late) ==
    LET C0 == Leave(C, LeaseLost(C) \ Late, "failed", "lease_lost", TRUE)
        TO == TimeoutOp(C0, Overdue(C) \ Late)
        C1 == [TO EXCEPT !.eff = C0.eff \cup TO.eff]
        silent == /\ C.peer = "ready" /\ C.heard > PeerTimeout
                  /\ \E h \in C.hbs : h.age > PeerTimeout
        C2 == PeerLostOp(C1)
    IN  IF silent THEN [C2 EXCEPT !.eff = @ \cup C1.eff \cup {DropPeer}] ELSE C1

(* The prompt lease check: every lost lease fails at this tick (an unbounded budget). *)
TickLossOp(C) == TickLossLagOp(C, {})

(* The requests whose claim a due heartbeat re-presents: claiming, of a ready peer, and
   admitted at least HeartbeatInterval ago (their lease ran down that far). *)
Reclaim(C) ==
    IF C.peer = "ready"
    THEN {q \in Requests : C.dst[q] = "claiming"
                          /\ C.dlease[q] <= TermOf[q] - MaxDelay - HeartbeatInterval}
    ELSE {}

(* event tick, second part: when the heartbeat is due, forget heartbeats older than
   LeaseExtension (no ack of theirs could extend anything), send the batches B, and
   re-present the unanswered claims of Reclaim(C) (effect claim: a lost claim or grant
   costs about one heartbeat interval; P's gate answers a repeat as the first). *)
TickHbOp(C, B) ==
    IF C.hbWait > 0 THEN C
    ELSE [C EXCEPT !.hbWait = HeartbeatInterval,
                   !.hbs = {h \in C.hbs : h.age <= LeaseExtension}
                           \cup {[seq |-> b.seq, rs |-> b.rs, age |-> 0] : b \in B},
                   !.eff = (IF B = {} THEN @ ELSE @ \cup {HbEffect})
                           \cup {E("claim", q, "") : q \in Reclaim(C)}]

(* event tick (Consumer.tick), at the current time; DTickLagOp: the partial tick whose
   work budget left the lost leases in Late for a later tick *)
DTickLagOp(C, Late, B) == TickHbOp(TickLossLagOp(C, Late), B)
DTickOp(C, B) == DTickLagOp(C, {}, B)

-----------------------------------------------------------------------------
(* The actions of the graph model: any input, each with the condition under which
   Python's event does something (the no-op cases are left out of the graph). *)

Init == /\ dst = InitC.dst /\ dlease = InitC.dlease /\ abortPending = InitC.abortPending
        /\ owner = InitC.owner /\ peer = InitC.peer /\ hbs = InitC.hbs
        /\ hbWait = InitC.hbWait /\ heard = InitC.heard /\ eff = InitC.eff
        /\ rdl = InitC.rdl /\ quar = InitC.quar /\ inflight = InitC.inflight
        /\ pulls = InitC.pulls /\ mayRead = InitC.mayRead

Admit(r) == dst[r] = "new" /\ Become(AdmitOp(Cur, r, 0))

(* P's gate answers r's claim: events claim_granted, claim_refused. *)
ClaimResult(r, ok) == dst[r] = "claiming" /\ Become(ClaimResultOp(Cur, r, ok))
ClaimGranted(r) == ClaimResult(r, TRUE)
ClaimRefused(r) == ClaimResult(r, FALSE)

(* P says r will never be registered. *)
Never(r) == dst[r] \in Active /\ Become(NeverOp(Cur, r))

HandshakeOk == peer = "handshaking" /\ Become(HandshakeOkOp(Cur))

HandshakeFailed == peer = "handshaking" /\ Become(HandshakeFailedOp(Cur, "handshake"))

Schedule(r) == dst[r] = "waiting" /\ Become(ScheduleOp(Cur, r))

ReadOk(r, attached) == dst[r] = "reading" /\ Become(ReadOkOp(Cur, r, attached))

ReadFailed(r, fenced) == dst[r] = "reading" /\ Become(ReadFailedOp(Cur, r, fenced))

DAbort(r) == dst[r] \in Active /\ ~abortPending[r] /\ Become(DAbortOp(Cur, r))

(* P acks h (a member of hbs), granting LeaseExtension and refusing R; DAckUnknown: an
   ack whose heartbeat is not outstanding (pruned, or already answered). *)
DAck(h, R) == h \in hbs /\ Become(DAckOp(Cur, {h}, LeaseExtension, R, {}))

DAckUnknown == Become(DAckOp(Cur, {}, LeaseExtension, {}, {}))

PeerLost == peer # "unknown" /\ Become(PeerLostOp(Cur))

(* one time unit passes, then D's tick runs, promptly: the graph models' Python Consumer
   has a work budget larger than their requests, so no loss is ever late there (trace
   validation takes each tick's late set from the journal: DTickLagOp) *)
DTick == LET C == TickLossOp(Shift(Cur, 1)) IN Become(TickHbOp(C, HbCanon(C)))

(* The transport reports the end of a quarantined READ (landed or failed). *)
ReadEnd(r, b) == r \in quar /\ Become(IF b THEN ReadOkOp(Cur, r, TRUE) ELSE ReadFailedOp(Cur, r, FALSE))

(* Another load of a request that finished (a retry, a recompute asking again). *)
Readmit(r) == dst[r] \in {"done", "failed"} /\ Become(ReadmitOp(Cur, r))

Next ==
    \/ \E r \in Requests : Admit(r) \/ Schedule(r) \/ DAbort(r) \/ Readmit(r) \/ Never(r)
                           \/ ClaimGranted(r) \/ ClaimRefused(r)
                           \/ \E b \in BOOLEAN : ReadOk(r, b) \/ ReadFailed(r, b) \/ ReadEnd(r, b)
    \/ \E h \in hbs, R \in SUBSET Requests : DAck(h, R)
    \/ DAckUnknown \/ HandshakeOk \/ HandshakeFailed \/ PeerLost \/ DTick

TypeOK ==
    /\ dst \in [Requests -> DStates]
    /\ dlease \in [Requests -> Int]
    /\ abortPending \in [Requests -> BOOLEAN]
    /\ owner \in [Groups -> Requests \cup {"none"}]
    /\ peer \in PeerStates
    /\ \A h \in hbs : h.rs \subseteq Requests /\ h.age \in Nat
    /\ hbWait \in 0..HeartbeatInterval
    /\ heard \in 0..(PeerTimeout + 1)
    /\ rdl \in [Requests -> Int]
    /\ quar \subseteq Requests /\ inflight \subseteq Requests
    /\ pulls \in [Requests -> Nat]
    /\ mayRead \subseteq Requests

(* D's promises: one member of a group read (at most one owner, and only an owner
   reads); release is never an effect of a step that leaves a READ in flight; only a
   ready peer has heartbeats awaiting an ack. *)
OneReadPerGroup == \A r \in Requests : dst[r] = "reading" /\ GroupOf[r] # NoGroup
                                       => owner[GroupOf[r]] = r
NoReleaseUnderRead == \A r \in Requests : dst[r] = "reading" => Release(r) \notin eff
HbOnlyWhenReady == hbs # {} => peer = "ready"

(* Bounded reads: a READ the transport has not reported ended belongs to a request that
   is reading or quarantined: its local blocks never went back to the engine (no
   quarantined block is reused). *)
NoQuarantinedReuse == \A r \in inflight : dst[r] = "reading" \/ r \in quar
(* No second pull: each request (engine, epoch, handle) is read at most once on D. *)
NoSecondPull == \A r \in Requests : pulls[r] <= 1
(* One consumer per handle, D's half: a request whose params carry a capability is read
   only after P's gate granted its claim (the handle is bound to this consumer), so
   KVGate's NoFreeUnderRead holds per claimant. *)
ReadOnlyGranted == \A r \in Requests : pulls[r] > 0 => r \in mayRead
=============================================================================
