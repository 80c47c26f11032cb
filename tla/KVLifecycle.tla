----------------------------- MODULE KVLifecycle -----------------------------
(***************************************************************************)
(* The whole KV-block lifecycle: P's ledger (module KVLedger, instantiated *)
(* as P), several D readers per request (heterogeneous fan-in), sibling    *)
(* groups, a network that loses, duplicates, reorders and delays messages, *)
(* D crashes, client aborts on P and on D, and discrete time.              *)
(*                                                                         *)
(* D mirrors kvproto.lifecycle.Consumer (one machine per (request, reader) *)
(* pair, D_TRANSITIONS): states new, handshaking, waiting, reading, done,  *)
(* failed. NAMES: an action is the Python event's name in CamelCase        *)
(* (admit -> Admit, handshake_failed -> HandshakeFailed, read_ok -> ReadOk, *)
(* read_failed -> ReadFailed, peer_lost -> PeerLost); D events whose bare  *)
(* name P already uses get a D prefix (abort -> DAbort, ack -> DAck, tick  *)
(* [lease_lost] -> DTick), like the Python event classes. Message kinds    *)
(* are the wire names (params, done, release, heartbeat, ack). The peer    *)
(* states are lifecycle.PEER_STATES: unknown, handshaking, ready.          *)
(*                                                                         *)
(* TIME. One Tick = one time unit. All times are RELATIVE (remaining lease *)
(* on P, remaining lease as D believes it, age of a message, age of a      *)
(* READ), so the state space is finite without bounding time, and         *)
(* liveness can be checked. Bounds are enforced by disabling Tick:         *)
(*  - a message is delivered (or lost) at most MaxDelay units after send;  *)
(*  - a READ completes at most MaxReadTime units after it started; a READ  *)
(*    that completes at the very instant P's sweep frees the request       *)
(*    counts as completed first (READ in flight during [s, s+MaxReadTime));*)
(*  - D sends its heartbeats exactly every HeartbeatInterval units, from  *)
(*    its tick (Consumer.tick): the Tick step sends the batches that come  *)
(*    due, so heartbeats leave at the start of a time unit;                *)
(*  - P's scheduler registers a request in the same time unit in which it *)
(*    hands out the transfer params (Prefill); early messages still occur. *)
(* CLOCK DRIFT is modelled by its worst case: P's clock runs fast, so each *)
(* term P grants (InitialLease, LeaseExtension, AbortGrace) elapses        *)
(* ClockDrift units early on D's clock; D computes with the true terms.    *)
(***************************************************************************)
EXTENDS Naturals, Integers, Sequences, FiniteSets, TLC

CONSTANTS
    Requests, Readers, Blocks, BlocksOf, GroupOf, NoGroup, RegExpected,
    InitialLease, LeaseExtension, AbortGrace, MaxStaged, MaxStagedMsgs, MaxStagedAge,
    BugCountMessages, BugDropEarly, BugAbortFreesNow,
    ReadersOf,          \* [Requests -> SUBSET Readers]: who pulls each request (fan-in)
    HeartbeatInterval,  \* Config.heartbeat_interval
    MaxDelay,           \* Config.max_delay
    MaxReadTime,        \* Config.max_read_time
    ClockDrift,         \* Config.clock_drift
    MaxLoss,            \* network: messages lost, at most
    MaxDup,             \* network: deliveries that keep the message (duplicates), at most
    MaxCrashes,         \* D ranks that crash, at most
    MaxPAborts,         \* client/router aborts on P, at most
    MaxDAborts,         \* client aborts on D, at most
    MaxReadErrors,      \* READs that fail (transfer error), at most
    MaxHsFail,          \* failed handshakes, at most
    MaxPeerLost,        \* times a D rank loses its P engine (disconnect, or ack silence for
                        \* Config.peer_timeout), at most
    PeerReadyAtStart,   \* D ranks start with the P engine already handshaken
    EarlyRequests,      \* requests whose Register is a separate step after Prefill (in the
                        \* same time unit), so D's messages can arrive before it (staging);
                        \* the others are registered in the Prefill step itself
    ExpiryMayLag        \* TRUE: a Tick may leave any due requests for a later Tick (the
                        \* ledger's bounded tick, Config.max_tick_work); the safety models
                        \* set it, the liveness models check prompt expiry

VARIABLES
    \* P's ledger (see KVLedger for the mapping to kvproto.lifecycle.Ledger)
    pstate, expected, finished, released, deadline, reports, rc,
    stagedQ, staged, stagedAge, groupsDone, nfree,
    pre,          \* [Requests -> BOOLEAN]: prefill done, transfer params handed out
    \* D (kvproto.lifecycle.Consumer), per pair <<r, d>>
    dst,          \* D state of the pair
    dlease,       \* D's lease end, relative (waiting/handshaking only; else 0)
    readAge,      \* time units the in-flight READ has run (reading only)
    abortPending, \* client abort arrived during the READ
    owner,        \* [Readers -> [Groups -> Requests \cup {"none"}]]: the member D reads
    peer,         \* [Readers -> PeerStates]: D's view of its P engine
    hbTimer,      \* [Readers -> 0..HeartbeatInterval]: Ticks until D's next heartbeat
    crashed,      \* crashed D ranks
    \* network and fault budgets
    msgs,         \* set of in-flight messages
    nLoss, nDup, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost,
    reported,     \* GHOST: [Requests -> SUBSET Readers] whose done/release reached P
    flaw,         \* GHOST: name of the step property a step violated, "none" so far
    hsSlow        \* GHOST: pairs whose handshake was still running when time passed

ledgerVars == <<pstate, expected, finished, released, deadline, reports, rc,
                stagedQ, staged, stagedAge, groupsDone, nfree>>
dVars == <<pre, dst, dlease, readAge, abortPending, owner, peer, hbTimer, crashed>>
netVars == <<msgs, nLoss, nDup, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost,
             reported, flaw, hsSlow>>
vars == <<ledgerVars, dVars, netVars>>

Max(a, b) == IF a >= b THEN a ELSE b

(* P's ledger, with P's clock running fast by ClockDrift over each term. *)
P == INSTANCE KVLedger WITH
        InitialLease <- InitialLease - ClockDrift,
        LeaseExtension <- LeaseExtension - ClockDrift,
        AbortGrace <- Max(AbortGrace - ClockDrift, 0),
        LedgerMaxExpected <- Cardinality(Readers)

(* D's group contract (one member per group is read) is kept per rank; it only
   protects the sibling cascade if all members of a group have the same readers. *)
ASSUME \A q, r \in Requests : GroupOf[q] = GroupOf[r] /\ GroupOf[r] # NoGroup
                              => ReadersOf[q] = ReadersOf[r]

Held == P!Held
Terminal == P!Terminal
Groups == P!Groups
Pairs == {<<r, d>> : r \in Requests, d \in Readers}
IsPair(r, d) == d \in ReadersOf[r]
NExp(r) == Cardinality(ReadersOf[r])    \* TransferParams.expected, sent by D in every message
DStates == {"new", "handshaking", "waiting", "reading", "done", "failed"}
MsgKinds == {"params", "done", "release", "heartbeat", "ack"}
PeerStates == {"unknown", "handshaking", "ready"}   \* lifecycle.PEER_STATES

(* Messages: k kind, rs requests (one, except for the heartbeat batch and its ack),
   d reader, age = units in flight; for "ack": x = the lease end D derives from it,
   relative (send time of the heartbeat + term - drift - now), ref = refused handles.
   One field set for all kinds (TLC compares the records of a set). *)
MsgB(k, rs, d, x, ref) == [k |-> k, rs |-> rs, d |-> d, age |-> 0, x |-> x, ref |-> ref]
Msg(k, r, d) == MsgB(k, {r}, d, 0, {})
Req(m) == CHOOSE r \in m.rs : TRUE      \* the request of a single-request message

(* Consumer._read_fits: now + max_read_time + clock_drift <= lease_end *)
ReadFits(l) == MaxReadTime + ClockDrift <= l

Alive(d) == d \notin crashed

-----------------------------------------------------------------------------
(* P side *)

RECURSIVE RegisterAll(_, _)
RegisterAll(L, S) == IF S = {} THEN L
                     ELSE LET r == CHOOSE q \in S : TRUE IN RegisterAll(P!RegisterOp(L, r), S \ {r})

(* The units of prefill: a sibling group together, a request without group alone. *)
PrefillUnits == {{q \in Requests : GroupOf[q] = GroupOf[r]} : r \in {x \in Requests : GroupOf[x] # NoGroup}}
                \cup {{r} : r \in {x \in Requests : GroupOf[x] = NoGroup}}

(* Prefill finished for the requests of S (a sibling group finishes its prefill together):
   the engine hands out their transfer params (router -> D). Requests outside
   EarlyRequests are registered in this same step; the others by a later Register. *)
Prefill(S) ==
    /\ S # {} /\ \A r \in S : ~pre[r]
    /\ pre' = [r \in Requests |-> pre[r] \/ r \in S]
    /\ msgs' = msgs \cup UNION {{Msg("params", r, d) : d \in ReadersOf[r]} : r \in S}
    /\ P!Write(RegisterAll(P!Cur, S \ EarlyRequests))
    /\ UNCHANGED <<dst, dlease, readAge, abortPending, owner, peer, hbTimer, crashed,
                   nLoss, nDup, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, reported, flaw, hsSlow>>

(* mirrors kvproto.lifecycle.Ledger.register *)
Register(r) ==
    /\ pre[r] /\ pstate[r] = "unregistered"
    /\ P!Register(r)
    /\ UNCHANGED <<dVars, netVars>>

(* mirrors kvproto.lifecycle.Ledger.abort (client or router abort on P) *)
Abort(r) ==
    /\ nPAbort < MaxPAborts /\ pstate[r] \in P!HeldLive
    /\ nPAbort' = nPAbort + 1
    /\ P!Abort(r)
    /\ UNCHANGED <<dVars, msgs, nLoss, nDup, nCrash, nDAbort, nReadErr, nHsFail, nPeerLost, reported, flaw, hsSlow>>

(* Delivery of m to its receiver, which sends the messages in out. Either m leaves
   the network, or it stays as a duplicate to be delivered again (budget MaxDup). *)
Deliver(m, out) == \/ msgs' = (msgs \ {m}) \cup out /\ UNCHANGED nDup
                   \/ nDup < MaxDup /\ msgs' = msgs \cup out /\ nDup' = nDup + 1

(* GHOST check of StaleIsHarmless on a delivery step (after the ledger's update):
   for a terminal request of the message nothing of it changes, and a message about a
   single terminal request changes nothing at all on P. *)
StaleCheck(rs) ==
    flaw' = IF \E r \in rs : pstate[r] \in Terminal /\
                  \/ pstate'[r] # pstate[r] \/ nfree'[r] # nfree[r]
                  \/ staged'[r] # <<>> \/ finished'[r] # {} \/ expected'[r] # 0
                  \/ (rs = {r} /\ ledgerVars' # ledgerVars)
            THEN "StaleIsHarmless" ELSE flaw

Report(m) == reported' = IF pstate[Req(m)] \in Terminal THEN reported
                         ELSE [reported EXCEPT ![Req(m)] = @ \cup {m.d}]

(* mirrors kvproto.lifecycle.Ledger.done (the notification of a READ) *)
Done(m) ==
    /\ m \in msgs /\ m.k = "done" /\ Deliver(m, {})
    /\ P!Done(Req(m), m.d, NExp(Req(m)))
    /\ Report(m)
    /\ StaleCheck({Req(m)})
    /\ UNCHANGED <<dVars, nLoss, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, hsSlow>>

(* mirrors kvproto.lifecycle.Ledger.release *)
Release(m) ==
    /\ m \in msgs /\ m.k = "release" /\ Deliver(m, {})
    /\ P!Release(Req(m), m.d, NExp(Req(m)))
    /\ Report(m)
    /\ StaleCheck({Req(m)})
    /\ UNCHANGED <<dVars, nLoss, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, hsSlow>>

(* mirrors kvproto.lifecycle.Ledger.heartbeat (one batch); P answers with one ack
   (term = LeaseExtension; refused = the aborted/expired/freed handles). *)
Heartbeat(m) ==
    /\ m \in msgs /\ m.k = "heartbeat"
    /\ LET ref == {r \in m.rs : P!HeartbeatRefused(P!Cur, r)}
           ack == MsgB("ack", m.rs, m.d, Max(LeaseExtension - ClockDrift - m.age, 0), ref)
       IN  Deliver(m, {ack})
    /\ P!Write(P!HeartbeatBatchOp(P!Cur, m.rs, m.d, m.x))
    /\ StaleCheck(m.rs)
    /\ UNCHANGED <<dVars, nLoss, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, reported, hsSlow>>

(* The network loses a message (budget MaxLoss). *)
Lose(m) ==
    /\ m \in msgs /\ nLoss < MaxLoss
    /\ msgs' = msgs \ {m} /\ nLoss' = nLoss + 1
    /\ UNCHANGED <<ledgerVars, dVars, nDup, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, reported, flaw, hsSlow>>

-----------------------------------------------------------------------------
(* D side: kvproto.lifecycle.Consumer, one machine per pair <<r, d>>. *)

SetD(r, d, s) == dst' = [dst EXCEPT ![<<r, d>>] = s]
Send(ms) == msgs' = msgs \cup ms
(* Leaving the pair's active states: per-pair fields back to their rest values. *)
Rest(r, d) == /\ dlease' = [dlease EXCEPT ![<<r, d>>] = 0]
              /\ readAge' = [readAge EXCEPT ![<<r, d>>] = 0]
              /\ abortPending' = [abortPending EXCEPT ![<<r, d>>] = FALSE]
(* Effect "disown" of a D_TRANSITIONS row: a failed pair gives up its group ownership. *)
Disown(r, d) == owner' = IF GroupOf[r] # NoGroup /\ owner[d][GroupOf[r]] = r
                         THEN [owner EXCEPT ![d][GroupOf[r]] = "none"] ELSE owner

(* mirrors kvproto.lifecycle.Consumer.admit (rows ADMIT/peer_ready, peer_unknown,
   lease_short). The initial term is aged by MaxDelay. A duplicate is ignored. *)
Admit(m) ==
    /\ m \in msgs /\ m.k = "params"
    /\ LET r == Req(m)  d == m.d  l == InitialLease - MaxDelay
       IN  IF ~Alive(d) \/ dst[<<r, d>>] # "new"
           THEN Deliver(m, {}) /\ UNCHANGED <<dst, dlease, peer>>       \* duplicate_admit
           ELSE IF ~ReadFits(l)
           THEN /\ Deliver(m, {Msg("release", r, d)})                \* lease_short
                /\ SetD(r, d, "failed") /\ UNCHANGED <<dlease, peer>>
           ELSE /\ Deliver(m, {})
                /\ dlease' = [dlease EXCEPT ![<<r, d>>] = l]
                /\ IF peer[d] = "ready" THEN SetD(r, d, "waiting") /\ UNCHANGED peer
                   ELSE /\ SetD(r, d, "handshaking")                     \* (start or join)
                        /\ peer' = [peer EXCEPT ![d] = "handshaking"]
    /\ UNCHANGED <<ledgerVars, pre, readAge, abortPending, owner, hbTimer, crashed,
                   nLoss, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, reported, flaw, hsSlow>>

(* mirrors kvproto.lifecycle.Consumer.handshake_result(ok=True) *)
HandshakeOk(d) ==
    /\ Alive(d) /\ peer[d] = "handshaking"
    /\ peer' = [peer EXCEPT ![d] = "ready"]
    /\ dst' = [p \in Pairs |-> IF p[2] = d /\ dst[p] = "handshaking" THEN "waiting" ELSE dst[p]]
    /\ UNCHANGED <<ledgerVars, pre, dlease, readAge, abortPending, owner, hbTimer, crashed, netVars>>

(* mirrors kvproto.lifecycle.Consumer.handshake_result(ok=False), event handshake_failed:
   no release (P expires) *)
HandshakeFailed(d) ==
    /\ Alive(d) /\ peer[d] = "handshaking" /\ nHsFail < MaxHsFail
    /\ nHsFail' = nHsFail + 1
    /\ peer' = [peer EXCEPT ![d] = "unknown"]
    /\ dst' = [p \in Pairs |-> IF p[2] = d /\ dst[p] = "handshaking" THEN "failed" ELSE dst[p]]
    /\ dlease' = [p \in Pairs |-> IF p[2] = d /\ dst[p] = "handshaking" THEN 0 ELSE dlease[p]]
    /\ UNCHANGED <<ledgerVars, pre, readAge, abortPending, owner, hbTimer, crashed,
                   msgs, nLoss, nDup, nCrash, nPAbort, nDAbort, nReadErr, nPeerLost, reported, flaw, hsSlow>>

(* mirrors kvproto.lifecycle.Consumer.schedule: rows SCHEDULE/sibling_local (release),
   SCHEDULE/lease_short (release), SCHEDULE/lease_covers_read (post the READ). *)
Schedule(r, d) ==
    /\ IsPair(r, d) /\ Alive(d) /\ dst[<<r, d>>] = "waiting"
    /\ LET g == GroupOf[r] IN
       IF g # NoGroup /\ owner[d][g] \notin {"none", r}
       THEN /\ SetD(r, d, "done") /\ Rest(r, d) /\ UNCHANGED owner
            /\ Send({Msg("release", r, d)})
       ELSE IF ~ReadFits(dlease[<<r, d>>])
       THEN /\ SetD(r, d, "failed") /\ Rest(r, d) /\ Disown(r, d)
            /\ Send({Msg("release", r, d)})
       ELSE /\ SetD(r, d, "reading")
            /\ dlease' = [dlease EXCEPT ![<<r, d>>] = 0]
            /\ readAge' = [readAge EXCEPT ![<<r, d>>] = 0]
            /\ owner' = IF g # NoGroup THEN [owner EXCEPT ![d][g] = r] ELSE owner
            /\ UNCHANGED <<msgs, abortPending>>
    /\ UNCHANGED <<ledgerVars, pre, peer, hbTimer, crashed,
                   nLoss, nDup, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, reported, flaw, hsSlow>>

(* mirrors kvproto.lifecycle.Consumer.read_result(ok=True), event read_ok: rows
   READ_OK/ok (done), READ_OK/abort_pending (failed, but the done notification is sent,
   so the pair keeps its group: no disown). *)
ReadOk(r, d) ==
    /\ IsPair(r, d) /\ Alive(d) /\ dst[<<r, d>>] = "reading"
    /\ IF abortPending[<<r, d>>] THEN SetD(r, d, "failed") ELSE SetD(r, d, "done")
    /\ UNCHANGED owner
    /\ Rest(r, d)
    /\ Send({Msg("done", r, d)})
    /\ UNCHANGED <<ledgerVars, pre, peer, hbTimer, crashed,
                   nLoss, nDup, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, reported, flaw, hsSlow>>

(* mirrors kvproto.lifecycle.Consumer.read_result(ok=False), event read_failed: rows
   READ_FAILED/error and /fenced (release, disown; the model does not tell them apart) *)
ReadFailed(r, d) ==
    /\ IsPair(r, d) /\ Alive(d) /\ dst[<<r, d>>] = "reading" /\ nReadErr < MaxReadErrors
    /\ nReadErr' = nReadErr + 1
    /\ SetD(r, d, "failed") /\ Disown(r, d) /\ Rest(r, d)
    /\ Send({Msg("release", r, d)})
    /\ UNCHANGED <<ledgerVars, pre, peer, hbTimer, crashed,
                   nLoss, nDup, nCrash, nPAbort, nDAbort, nHsFail, nPeerLost, reported, flaw, hsSlow>>

(* mirrors kvproto.lifecycle.Consumer.abort (client abort on D): rows D_ABORT/idle
   (release), D_ABORT/in_flight (never release under an in-flight READ). *)
DAbort(r, d) ==
    /\ IsPair(r, d) /\ Alive(d) /\ nDAbort < MaxDAborts
    /\ dst[<<r, d>>] \in {"waiting", "handshaking", "reading"}
    /\ ~abortPending[<<r, d>>]
    /\ nDAbort' = nDAbort + 1
    /\ IF dst[<<r, d>>] = "reading"
       THEN /\ abortPending' = [abortPending EXCEPT ![<<r, d>>] = TRUE]
            /\ UNCHANGED <<dst, dlease, readAge, owner, msgs>>
       ELSE /\ SetD(r, d, "failed") /\ Rest(r, d) /\ Disown(r, d)
            /\ Send({Msg("release", r, d)})
    /\ UNCHANGED <<ledgerVars, pre, peer, hbTimer, crashed,
                   nLoss, nDup, nCrash, nPAbort, nReadErr, nHsFail, nPeerLost, reported, flaw, hsSlow>>

(* mirrors kvproto.lifecycle.Consumer.ack, event ack: rows ACK/granted (lease end :=
   heartbeat send time + term - drift, never lowered), ACK/refused (waiting -> failed,
   release so that an aborted request frees now, disown; reading -> let the READ
   finish). An ack that reaches a rank which lost its peer since is ignored, as Python
   forgets the outstanding heartbeats of a lost peer. *)
DAck(m) ==
    /\ m \in msgs /\ m.k = "ack"
    /\ LET live(r) == IsPair(r, m.d) /\ Alive(m.d) /\ peer[m.d] = "ready"
                       /\ dst[<<r, m.d>>] \in {"waiting", "reading"}
           revoked == {r \in m.rs : live(r) /\ r \in m.ref /\ dst[<<r, m.d>>] = "waiting"}
           granted == {r \in m.rs : live(r) /\ r \notin m.ref /\ dst[<<r, m.d>>] = "waiting"}
       IN  /\ Deliver(m, {Msg("release", r, m.d) : r \in revoked})
           /\ dst' = [p \in Pairs |-> IF p[2] = m.d /\ p[1] \in revoked THEN "failed" ELSE dst[p]]
           /\ dlease' = [p \in Pairs |-> IF p[2] # m.d THEN dlease[p]
                                         ELSE IF p[1] \in revoked THEN 0
                                         ELSE IF p[1] \in granted THEN Max(dlease[p], m.x)
                                         ELSE dlease[p]]
           /\ owner' = [owner EXCEPT ![m.d] = [g \in Groups |->
                            IF owner[m.d][g] \in revoked THEN "none" ELSE owner[m.d][g]]]
    /\ UNCHANGED <<ledgerVars, pre, readAge, abortPending, peer, hbTimer, crashed,
                   nLoss, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, reported, flaw, hsSlow>>

(* mirrors the lease check of kvproto.lifecycle.Consumer.tick, event tick: row
   D_TICK/lease_lost (release, disown) *)
DTick(r, d) ==
    /\ IsPair(r, d) /\ Alive(d) /\ dst[<<r, d>>] \in {"waiting", "handshaking"}
    /\ ~ReadFits(dlease[<<r, d>>])
    /\ SetD(r, d, "failed") /\ Rest(r, d) /\ Disown(r, d)
    /\ Send({Msg("release", r, d)})
    /\ UNCHANGED <<ledgerVars, pre, peer, hbTimer, crashed,
                   nLoss, nDup, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, reported, flaw, hsSlow>>

(* mirrors the heartbeat part of kvproto.lifecycle.Consumer.tick: the batches D sends
   when its heartbeat comes due, one per expected-reader count, covering every request D
   still intends to pull (waiting, queued ones too, and reading) of a ready peer. Sent by
   Tick (D's tick runs as time passes). *)
HbBatches(d) ==
    LET pull == {q \in Requests : IsPair(q, d) /\ peer[d] = "ready"
                                 /\ dst[<<q, d>>] \in {"waiting", "reading"}}
    IN  {MsgB("heartbeat", {q \in pull : NExp(q) = e}, d, e, {}) : e \in {NExp(q) : q \in pull}}

(* mirrors kvproto.lifecycle.Consumer.peer_lost, and the ack-silence check of
   Consumer.tick (no ack for Config.peer_timeout: the same rows), event peer_lost: rows
   PEER_LOST/lost (waiting, handshaking -> failed; no release, P expires them) and
   PEER_LOST/in_flight (a READ in flight reports its own fate). A fault (budget
   MaxPeerLost): the network or P fails, or P falls silent. *)
PeerLost(d) ==
    /\ Alive(d) /\ peer[d] # "unknown" /\ nPeerLost < MaxPeerLost
    /\ nPeerLost' = nPeerLost + 1
    /\ peer' = [peer EXCEPT ![d] = "unknown"]
    /\ LET lost == {p \in Pairs : p[2] = d /\ dst[p] \in {"waiting", "handshaking"}}
       IN  /\ dst' = [p \in Pairs |-> IF p \in lost THEN "failed" ELSE dst[p]]
           /\ dlease' = [p \in Pairs |-> IF p \in lost THEN 0 ELSE dlease[p]]
    /\ UNCHANGED <<ledgerVars, pre, readAge, abortPending, owner, hbTimer, crashed,
                   msgs, nLoss, nDup, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, reported,
                   flaw, hsSlow>>

(* A D rank crashes: it sends nothing more and its READs stop (no message to P). *)
Crash(d) ==
    /\ Alive(d) /\ nCrash < MaxCrashes
    /\ nCrash' = nCrash + 1
    /\ crashed' = crashed \cup {d}
    /\ hbTimer' = [hbTimer EXCEPT ![d] = 0]
    /\ dst' = [p \in Pairs |-> IF p[2] = d /\ dst[p] \notin {"done", "failed"} THEN "failed" ELSE dst[p]]
    /\ dlease' = [p \in Pairs |-> IF p[2] = d THEN 0 ELSE dlease[p]]
    /\ readAge' = [p \in Pairs |-> IF p[2] = d THEN 0 ELSE readAge[p]]
    /\ abortPending' = [p \in Pairs |-> IF p[2] = d THEN FALSE ELSE abortPending[p]]
    /\ UNCHANGED <<ledgerVars, pre, owner, peer,
                   msgs, nLoss, nDup, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, reported, flaw, hsSlow>>

-----------------------------------------------------------------------------
(* Time. Disabled while something is due "now": a message at its delay bound, a READ
   at its time bound, a heartbeat due, a prefilled request not yet registered. *)
TimeBlocked ==
    \/ \E m \in msgs : m.age >= MaxDelay
    \/ \E p \in Pairs : dst[p] = "reading" /\ Alive(p[2]) /\ readAge[p] + 1 >= MaxReadTime
    \/ \E r \in Requests : pre[r] /\ pstate[r] = "unregistered"

Older(m) == [m EXCEPT !.age = @ + 1,
                      !.x = IF m.k = "ack" /\ m.x > 0 THEN @ - 1 ELSE @]

(* Readers whose heartbeat comes due at this Tick. *)
HbDue == {d \in Readers : Alive(d) /\ hbTimer[d] <= 1}

(* mirrors kvproto.lifecycle.Ledger.tick (P) and Consumer.tick (D: its clock, and the
   heartbeats that come due) *)
Tick ==
    /\ ~TimeBlocked
    /\ \E Late \in (IF ExpiryMayLag THEN SUBSET P!DueAtTick(P!Cur) ELSE {{}}) : P!TickLag(Late)
    /\ msgs' = {Older(m) : m \in msgs} \cup UNION {HbBatches(d) : d \in HbDue}
    /\ dlease' = [p \in Pairs |-> IF dst[p] \in {"waiting", "handshaking"}
                                  THEN Max(dlease[p] - 1, 0) ELSE dlease[p]]
    /\ readAge' = [p \in Pairs |-> IF dst[p] = "reading" THEN readAge[p] + 1 ELSE readAge[p]]
    /\ hbTimer' = [d \in Readers |-> IF ~Alive(d) THEN 0
                                    ELSE IF d \in HbDue THEN HeartbeatInterval
                                    ELSE hbTimer[d] - 1]
    /\ hsSlow' = hsSlow \cup {p \in Pairs : dst[p] = "handshaking"}
    /\ flaw' = IF \E r \in Requests :
                   /\ pstate[r] # "expired" /\ pstate'[r] = "expired" /\ nLoss = 0
                   /\ \E d \in ReadersOf[r] : /\ Alive(d) /\ <<r, d>> \notin hsSlow
                                             /\ dst[<<r, d>>] \in {"waiting", "reading"}
               THEN "RenewalKeepsLease" ELSE flaw
    /\ UNCHANGED <<pre, dst, abortPending, owner, peer, crashed,
                   nLoss, nDup, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost, reported>>

-----------------------------------------------------------------------------
Init ==
    /\ P!LedgerInit
    /\ pre = [r \in Requests |-> FALSE]
    /\ dst = [p \in Pairs |-> "new"]
    /\ dlease = [p \in Pairs |-> 0]
    /\ readAge = [p \in Pairs |-> 0]
    /\ abortPending = [p \in Pairs |-> FALSE]
    /\ owner = [d \in Readers |-> [g \in Groups |-> "none"]]
    /\ peer = [d \in Readers |-> IF PeerReadyAtStart THEN "ready" ELSE "unknown"]
    /\ hbTimer = [d \in Readers |-> HeartbeatInterval]
    /\ crashed = {}
    /\ msgs = {}
    /\ nLoss = 0 /\ nDup = 0 /\ nCrash = 0 /\ nPAbort = 0 /\ nDAbort = 0
    /\ nReadErr = 0 /\ nHsFail = 0 /\ nPeerLost = 0
    /\ reported = [r \in Requests |-> {}]
    /\ flaw = "none"
    /\ hsSlow = {}

Receive == \E m \in msgs : Done(m) \/ Release(m) \/ Heartbeat(m) \/ Admit(m) \/ DAck(m)
DStep == \E r \in Requests, d \in Readers :
            Schedule(r, d) \/ ReadOk(r, d) \/ DTick(r, d) \/ ReadFailed(r, d) \/ DAbort(r, d)

Next ==
    \/ \E S \in PrefillUnits : Prefill(S)
    \/ \E r \in Requests : Register(r) \/ Abort(r)
    \/ Receive
    \/ \E m \in msgs : Lose(m)
    \/ DStep
    \/ \E d \in Readers : HandshakeOk(d) \/ HandshakeFailed(d) \/ PeerLost(d) \/ Crash(d)
    \/ Tick

(* Fairness: time passes, messages are delivered, D and P do their work. Faults
   (loss, duplication, crash, aborts, READ errors, failed handshakes, peer loss) are not
   fair. *)
Fairness ==
    /\ WF_vars(Tick)
    /\ WF_vars(\E m \in msgs : (Done(m) \/ Release(m) \/ Heartbeat(m) \/ Admit(m) \/ DAck(m))
                               /\ msgs' # msgs /\ nDup' = nDup)
    /\ WF_vars(\E r \in Requests, d \in Readers : Schedule(r, d) \/ ReadOk(r, d) \/ DTick(r, d))
    /\ WF_vars((\E S \in PrefillUnits : Prefill(S)) \/ \E r \in Requests : Register(r))
    /\ WF_vars(\E d \in Readers : HandshakeOk(d))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Readers are interchangeable when every request is pulled by all of them (safety
   models only; the readers must then be model values). *)
ReaderSymmetry == Permutations(Readers)

(* The state as safety checking needs it (VIEW of the safety models): every variable,
   less the parts of the history no step and no invariant reads again. A part left out
   is never read again and never comes back, so two states with one view have the same
   steps, successors with one view and the same invariant values (spec/TLA.md, "The
   view and the symmetry"). tests/test_check.py checks that every variable is here. *)

(* The GHOST hsSlow, as far as Tick's RenewalKeepsLease check can still read it: pairs of
   a live reader, still active, of a request not yet expired or freed, and only while no
   message was lost. Pairs leave for done or failed, readers crash, requests end and
   nLoss grows, never the reverse. *)
LiveHsSlow == IF nLoss > 0 THEN {}
              ELSE {p \in hsSlow : /\ Alive(p[2]) /\ pstate[p[1]] \notin Terminal
                                   /\ dst[p] \in {"handshaking", "waiting", "reading"}}

(* D's group owners a step can still read: owner[d][g] is read and written only for a
   pair of d in group g that is not yet done or failed (Schedule, Disown, DAck). *)
LiveOwner == [d \in Readers |-> [g \in Groups |->
                 IF \E q \in Requests : /\ GroupOf[q] = g /\ IsPair(q, d)
                                        /\ dst[<<q, d>>] \notin {"done", "failed"}
                 THEN owner[d][g] ELSE "none"]]

(* A crashed reader's peer state: every step that reads peer[d] requires Alive(d). *)
LivePeer == [d \in Readers |-> IF Alive(d) THEN peer[d] ELSE "unknown"]

(* Groups transferred, as far as RegisterOp can still read them: a group with a member
   not yet registered. *)
LiveGroupsDone == {g \in groupsDone : \E q \in Requests : GroupOf[q] = g /\ pstate[q] = "unregistered"}

(* How a request or a pair ended is history: no step and no invariant tells an expired
   request from a freed one (both are Terminal: stale, refused, never held again; Tick's
   RenewalKeepsLease check reads "expired" only of a request that was held), nor a done
   pair from a failed one (both are ended: no D step leaves them). *)
Ended(v) == IF v \in Terminal \cup {"done", "failed"} THEN "ended" ELSE v
EndedPState == [r \in Requests |-> Ended(pstate[r])]
EndedDst == [p \in Pairs |-> Ended(dst[p])]

(* Left out entirely: the GHOST `reported`, read only by the liveness property
   ReportedIsFreed (never in a model with a VIEW). *)
SafetyView ==
    <<EndedPState, expected, finished, released, deadline, reports, rc,
      stagedQ, staged, stagedAge, LiveGroupsDone, nfree,
      pre, EndedDst, dlease, readAge, abortPending, LiveOwner, LivePeer, hbTimer, crashed,
      msgs, nLoss, nDup, nCrash, nPAbort, nDAbort, nReadErr, nHsFail, nPeerLost,
      flaw, LiveHsSlow>>

(* Invariants. Each is referenced from spec/TLA.md. *)

TypeOK ==
    /\ P!LedgerTypeOK
    /\ pre \in [Requests -> BOOLEAN]
    /\ dst \in [Pairs -> DStates]
    /\ dlease \in [Pairs -> Nat]
    /\ readAge \in [Pairs -> Nat]
    /\ abortPending \in [Pairs -> BOOLEAN]
    /\ owner \in [Readers -> [Groups -> Requests \cup {"none"}]]
    /\ peer \in [Readers -> PeerStates]
    /\ hbTimer \in [Readers -> 0..HeartbeatInterval]
    /\ crashed \subseteq Readers
    /\ \A m \in msgs : m.k \in MsgKinds /\ m.rs \subseteq Requests /\ m.d \in Readers
                       /\ m.age \in 0..MaxDelay /\ m.x \in Int /\ m.ref \subseteq m.rs
    /\ \A p \in Pairs : ~IsPair(p[1], p[2]) => dst[p] = "new"
    /\ reported \in [Requests -> SUBSET Readers]
    /\ flaw \in {"none", "StaleIsHarmless", "RenewalKeepsLease"}
    /\ hsSlow \subseteq Pairs

NoDoubleFree == P!NoDoubleFree
Conservation == P!Conservation
StagingBounded == P!StagingBounded

(* Blocks are never freed while a READ of them is in progress: the request being read
   still holds its blocks (on P's ledger, or, before register, in P's engine). *)
NoFreeUnderRead ==
    \A p \in Pairs : (dst[p] = "reading" /\ Alive(p[2])) =>
        \/ pstate[p[1]] \in Held
        \/ pstate[p[1]] = "unregistered" /\ pre[p[1]]

(* A message about an expired or freed request changes nothing on P: nothing of the
   request changes (it is not revived, re-freed, staged or counted), and a message about
   one terminal request leaves the whole ledger unchanged. Checked on every delivery
   step through the ghost flaw (see StaleCheck); KVLedger!StaleIsHarmlessLedger states
   it operator by operator for the ledger alone. *)
StaleIsHarmless == flaw # "StaleIsHarmless"

(* P never expires a request that a live reader is still waiting on or reading (and so
   heartbeating), unless the network lost a message or the reader's handshake was still
   running when time passed (before its handshake D cannot heartbeat: the initial term
   must cover the handshake). Checked on every Tick through the ghost flaw. An extension
   shorter than heartbeat interval + delay breaks it. *)
RenewalKeepsLease == flaw # "RenewalKeepsLease"

(* Liveness. *)
(* Every request handed out is eventually freed or expired. *)
NoLeak == \A r \in Requests : pre[r] ~> pstate[r] \in Terminal
(* A request whose readers all reported (done/release reached P) is freed by the
   protocol, without waiting for expiry. *)
ReportedIsFreed ==
    \A r \in Requests :
        (reported[r] = ReadersOf[r] /\ pstate[r] \notin Terminal) ~> pstate[r] = "freed"
=============================================================================
