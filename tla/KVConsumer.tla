----------------------------- MODULE KVConsumer -----------------------------
(***************************************************************************)
(* One D rank's machine alone: kvproto.lifecycle.Consumer for one reader  *)
(* and one P engine, driven by any input. It is to D_TRANSITIONS what     *)
(* KVLedger is to P_TRANSITIONS: the TLC side of the D state-graph        *)
(* equality check (kvproto.verify.dconformance). KVLifecycle's D actions  *)
(* are the same rows inside the whole protocol; the names agree with both *)
(* (see KVLifecycle's header): Admit, HandshakeOk, HandshakeFailed,       *)
(* Schedule, ReadOk, ReadFailed, DAbort, PeerLost, and Tick for D's       *)
(* tick (lease check; its heartbeats and P's acks are not modelled here). *)
(*                                                                         *)
(* ABSTRACTION (Python -> TLA+): dst[r] = Consumer.state(r), or the state *)
(* of its Finished effect once it left the machine; dlease[r] = lease end *)
(* - now while waiting or handshaking, else 0; abortPending[r] =          *)
(* Consumer.abort_pending(r); owner[g] = Consumer.group_owner(engine, g)  *)
(* or "none"; peer = Consumer.peer_state(engine); eff = the effects of the *)
(* last step as records (heartbeats left out).                             *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS Requests, GroupOf, NoGroup, TermOf, MaxDelay, MaxReadTime, ClockDrift

VARIABLES dst, dlease, abortPending, owner, peer, eff
vars == <<dst, dlease, abortPending, owner, peer, eff>>

Groups == {GroupOf[r] : r \in Requests} \ {NoGroup}
DStates == {"new", "handshaking", "waiting", "reading", "done", "failed"}
PeerStates == {"unknown", "handshaking", "ready"}   \* lifecycle.PEER_STATES
Active == {"handshaking", "waiting", "reading"}

(* Consumer._read_fits, relative: now + max_read_time + clock_drift <= lease end *)
ReadFits(l) == MaxReadTime + ClockDrift <= l

E(k, r, why) == [k |-> k, r |-> r, why |-> why]
Finish(r, why) == E("finish", r, why)
Release(r) == E("release", r, "")

(* Per-request fields back to rest when r leaves waiting/handshaking/reading. *)
Rest(S) == /\ dlease' = [q \in Requests |-> IF q \in S THEN 0 ELSE dlease[q]]
           /\ abortPending' = [q \in Requests |-> IF q \in S THEN FALSE ELSE abortPending[q]]
(* effect "disown" *)
Disown(r) == owner' = IF GroupOf[r] # NoGroup /\ owner[GroupOf[r]] = r
                      THEN [owner EXCEPT ![GroupOf[r]] = "none"] ELSE owner

Init ==
    /\ dst = [r \in Requests |-> "new"]
    /\ dlease = [r \in Requests |-> 0]
    /\ abortPending = [r \in Requests |-> FALSE]
    /\ owner = [g \in Groups |-> "none"]
    /\ peer = "unknown"
    /\ eff = {}

(* event admit: rows ADMIT/lease_short, peer_ready, peer_unknown (start or join) *)
Admit(r) ==
    /\ dst[r] = "new"
    /\ LET l == TermOf[r] - MaxDelay IN
       IF ~ReadFits(l)
       THEN /\ dst' = [dst EXCEPT ![r] = "failed"]
            /\ eff' = {Release(r), Finish(r, "lease_short")}
            /\ UNCHANGED <<dlease, peer>>
       ELSE /\ dlease' = [dlease EXCEPT ![r] = l]
            /\ IF peer = "ready"
               THEN dst' = [dst EXCEPT ![r] = "waiting"] /\ eff' = {} /\ UNCHANGED peer
               ELSE /\ dst' = [dst EXCEPT ![r] = "handshaking"]
                    /\ peer' = "handshaking"
                    /\ eff' = IF peer = "unknown" THEN {E("handshake", "", "")} ELSE {}
    /\ UNCHANGED <<abortPending, owner>>

(* event handshake_ok: row HANDSHAKE_OK/ok *)
HandshakeOk ==
    /\ peer = "handshaking"
    /\ peer' = "ready"
    /\ dst' = [r \in Requests |-> IF dst[r] = "handshaking" THEN "waiting" ELSE dst[r]]
    /\ eff' = {}
    /\ UNCHANGED <<dlease, abortPending, owner>>

(* event handshake_failed: row HANDSHAKE_FAILED/failed (no release: P expires) *)
HandshakeFailed ==
    /\ peer = "handshaking"
    /\ peer' = "unknown"
    /\ LET S == {r \in Requests : dst[r] = "handshaking"} IN
       /\ dst' = [r \in Requests |-> IF r \in S THEN "failed" ELSE dst[r]]
       /\ Rest(S)
       /\ eff' = {Finish(r, "handshake") : r \in S}
    /\ UNCHANGED owner

(* event schedule: rows SCHEDULE/sibling_in_flight, sibling_local, lease_short,
   lease_covers_read *)
Schedule(r) ==
    /\ dst[r] = "waiting"
    /\ LET g == GroupOf[r]
           o == IF g # NoGroup THEN owner[g] ELSE "none"
       IN  IF o \notin {"none", r} /\ dst[o] \in Active
           THEN UNCHANGED <<dst, dlease, abortPending, owner, peer>> /\ eff' = {}
           ELSE IF o \notin {"none", r}
           THEN /\ dst' = [dst EXCEPT ![r] = "done"] /\ Rest({r}) /\ UNCHANGED owner
                /\ eff' = {Release(r), Finish(r, "sibling_local")}
           ELSE IF ~ReadFits(dlease[r])
           THEN /\ dst' = [dst EXCEPT ![r] = "failed"] /\ Rest({r}) /\ Disown(r)
                /\ eff' = {Release(r), Finish(r, "lease_short")}
           ELSE /\ dst' = [dst EXCEPT ![r] = "reading"]
                /\ dlease' = [dlease EXCEPT ![r] = 0]
                /\ owner' = IF g # NoGroup THEN [owner EXCEPT ![g] = r] ELSE owner
                /\ eff' = {E("read", r, "")}
                /\ UNCHANGED abortPending
    /\ UNCHANGED peer

(* event read_ok: rows READ_OK/ok, abort_pending (done sent unless it rode on the
   READ; no disown: P heard done) *)
ReadOk(r, attached) ==
    /\ dst[r] = "reading"
    /\ dst' = [dst EXCEPT ![r] = IF abortPending[r] THEN "failed" ELSE "done"]
    /\ Rest({r})
    /\ eff' = (IF attached THEN {} ELSE {E("done", r, "")})
              \cup {Finish(r, IF abortPending[r] THEN "aborted" ELSE "pulled")}
    /\ UNCHANGED <<owner, peer>>

(* event read_failed: rows READ_FAILED/fenced, error *)
ReadFailed(r, fenced) ==
    /\ dst[r] = "reading"
    /\ dst' = [dst EXCEPT ![r] = "failed"]
    /\ Rest({r}) /\ Disown(r)
    /\ eff' = {Release(r), Finish(r, IF fenced THEN "fenced" ELSE "transfer_error")}
    /\ UNCHANGED peer

(* event abort (D): rows D_ABORT/idle, in_flight *)
DAbort(r) ==
    /\ dst[r] \in Active /\ ~abortPending[r]
    /\ IF dst[r] = "reading"
       THEN /\ abortPending' = [abortPending EXCEPT ![r] = TRUE]
            /\ UNCHANGED <<dst, dlease, owner>> /\ eff' = {}
       ELSE /\ dst' = [dst EXCEPT ![r] = "failed"] /\ Rest({r}) /\ Disown(r)
            /\ eff' = {Release(r), Finish(r, "aborted")}
    /\ UNCHANGED peer

(* event peer_lost: rows PEER_LOST/lost (no release), in_flight *)
PeerLost ==
    /\ peer # "unknown"
    /\ peer' = "unknown"
    /\ LET S == {r \in Requests : dst[r] \in {"waiting", "handshaking"}} IN
       /\ dst' = [r \in Requests |-> IF r \in S THEN "failed" ELSE dst[r]]
       /\ Rest(S)
       /\ eff' = {Finish(r, "peer_lost") : r \in S}
    /\ UNCHANGED owner

(* event tick: one time unit passes; rows D_TICK/lease_lost for every waiting or
   handshaking request whose lease can no longer cover a READ *)
Tick ==
    LET l(r) == IF dst[r] \in {"waiting", "handshaking"} THEN dlease[r] - 1 ELSE dlease[r]
        S == {r \in Requests : dst[r] \in {"waiting", "handshaking"} /\ ~ReadFits(l(r))}
    IN  /\ dst' = [r \in Requests |-> IF r \in S THEN "failed" ELSE dst[r]]
        /\ dlease' = [r \in Requests |-> IF r \in S THEN 0 ELSE l(r)]
        /\ abortPending' = [r \in Requests |-> IF r \in S THEN FALSE ELSE abortPending[r]]
        /\ owner' = [g \in Groups |-> IF owner[g] \in S THEN "none" ELSE owner[g]]
        /\ eff' = UNION {{Release(r), Finish(r, "lease_lost")} : r \in S}
        /\ UNCHANGED peer

Next ==
    \/ \E r \in Requests : Admit(r) \/ Schedule(r) \/ DAbort(r)
                           \/ \E b \in BOOLEAN : ReadOk(r, b) \/ ReadFailed(r, b)
    \/ HandshakeOk \/ HandshakeFailed \/ PeerLost \/ Tick

TypeOK ==
    /\ dst \in [Requests -> DStates]
    /\ dlease \in [Requests -> Nat]
    /\ abortPending \in [Requests -> BOOLEAN]
    /\ owner \in [Groups -> Requests \cup {"none"}]
    /\ peer \in PeerStates

(* D's promises: one member of a group read (at most one owner, and only an owner
   reads); release is never an effect of a step that leaves a READ in flight. *)
OneReadPerGroup == \A r \in Requests : dst[r] = "reading" /\ GroupOf[r] # NoGroup
                                       => owner[GroupOf[r]] = r
NoReleaseUnderRead == \A r \in Requests : dst[r] = "reading" => Release(r) \notin eff
=============================================================================
