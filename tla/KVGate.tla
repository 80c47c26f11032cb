------------------------------ MODULE KVGate ------------------------------
(***************************************************************************)
(* P's gate (kvproto.lifecycle.gate.Gate) in front of the ledger, with    *)
(* several consumers holding the same transfer params (a router retry, a  *)
(* migration, a hedged request). Mirrors GATE_TRANSITIONS name for name:  *)
(* states "open", "bound", "never"; events Present, GateRegister, Abandon *)
(* and Forget (inside Done, where the ledger frees).                       *)
(*                                                                         *)
(*   written[r]  chunks of r's prefill whose writes completed (0..Chunks)  *)
(*   aborted[r]  r's prefill aborted after its params left (Abandon ran)   *)
(*   gstate[r]   Gate.state(r)                                             *)
(*   bound[r]    Gate.consumer(r), "none" when no consumer is bound        *)
(*   pstate[r]   the ledger, abstracted: "unregistered", "held", "freed"   *)
(*               (leases are KVLifecycle's: here only a done frees)        *)
(*   cstate[p]   consumer p[2]'s view of request p[1]: "waiting" (holds    *)
(*               the params), "claimed" (its claim bound the handle before *)
(*               the register: answered at the register), "granted" (the  *)
(*               gate let its claim through), "reading", "done", "failed"  *)
(*               (refused or told: recompute)                              *)
(*   told        GHOST: pairs told by a never-registered notice            *)
(*   untold      GHOST: pairs owed a notice that Abandon did not send      *)
(* A consumer posts its READ only after the gate granted its claim, and   *)
(* the gate grants a claim only while the ledger holds the handle (a claim *)
(* of an unregistered one is answered at the register), so NoFreeUnderRead *)
(* holds per claimant.                                                     *)
(*                                                                         *)
(* REFUSALS, row for row: register/unready and register/never change       *)
(* nothing (GateRegister's stuttering cases); present/bad_capability (a    *)
(* consumer in Forgers never got the params: every capability it presents *)
(* is wrong), present/foreign, present/never and present/full (the gate's  *)
(* records may be full of other handles' bindings, outside the model,     *)
(* when MayBeFull) fail the presenting consumer (it recomputes); a done,   *)
(* release or heartbeat from another consumer than the bound one is        *)
(* refused (present/foreign: Done, Release, Heartbeat). Not modelled: the  *)
(* eviction of the oldest never mark at the cap (never_evicted, not a row; *)
(* the handle is open again, and its request never registers).            *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, TLC

CONSTANTS
    Requests,           \* request handles
    Consumers,          \* consumers holding every request's params
    Chunks,             \* forward passes (chunked prefill) that fill a request's blocks
    BugSkipBinding,     \* BUG: a second consumer of a bound handle is let through
    BugRegisterUnready, \* BUG: a register after an earlier chunk reaches the ledger
    BugNoNeverNotice,   \* BUG: abandoning an unclaimed request tells nobody
    Forgers,            \* consumers that never got the params (wrong capability)
    MayBeFull,          \* the gate's records may be full (other handles' bindings)
    BugSkipCapability,  \* BUG: a wrong capability binds like the right one
    BugReadBeforeGrant  \* BUG: a consumer reads before the gate granted its claim

ASSUME Forgers \subseteq Consumers /\ MayBeFull \in BOOLEAN

VARIABLES written, aborted, gstate, bound, pstate, cstate, told, untold
vars == <<written, aborted, gstate, bound, pstate, cstate, told, untold>>

Pairs == Requests \X Consumers

(* mirrors the engine's forward pass: one more chunk of r written *)
Write(r) ==
    /\ ~aborted[r] /\ written[r] < Chunks
    /\ written' = [written EXCEPT ![r] = @ + 1]
    /\ UNCHANGED <<aborted, gstate, bound, pstate, cstate, told, untold>>

(* mirrors Gate.register: rows register/ready (pass), register/unready (refused,
   counted: nothing changes, the handle stays registrable), register/never (refused,
   counted: D was told). The adapter may try after any chunk; the readiness mark is
   written[r] = Chunks. *)
GateRegister(r) ==
    /\ written[r] > 0 /\ pstate[r] = "unregistered"
    /\ CASE gstate[r] = "never" -> UNCHANGED vars                        \* register/never
         [] written[r] = Chunks \/ BugRegisterUnready ->                  \* register/ready
              /\ pstate' = [pstate EXCEPT ![r] = "held"]
              \* the claim that bound r before its register is granted now
              /\ cstate' = [p \in Pairs |-> IF p[1] = r /\ cstate[p] = "claimed"
                                            THEN "granted" ELSE cstate[p]]
              /\ UNCHANGED <<written, aborted, gstate, bound, told, untold>>
         [] OTHER -> UNCHANGED vars                                      \* register/unready

(* mirrors Gate.present for a claim: rows present/first (bind), present/bad_capability
   (a forger's capability is wrong: refused, binds nothing), present/full (no room for
   another binding: refused, fail closed), present/same, present/foreign (refused),
   present/never (refused, told again). A refused consumer recomputes ("failed").
   full: with MayBeFull, any presentation that would bind may find the records full. *)
PresentOpen(r, c, full) ==
    CASE c \in Forgers /\ ~BugSkipCapability ->                       \* present/bad_capability
              /\ cstate' = [cstate EXCEPT ![<<r, c>>] = "failed"]
              /\ UNCHANGED <<gstate, bound, told>>
      [] full ->                                                       \* present/full
              /\ cstate' = [cstate EXCEPT ![<<r, c>>] = "failed"]
              /\ UNCHANGED <<gstate, bound, told>>
      [] OTHER ->                                                      \* present/first
              /\ gstate' = [gstate EXCEPT ![r] = "bound"]
              /\ bound' = [bound EXCEPT ![r] = c]
              \* answered at once when the ledger holds r, else at r's register
              /\ cstate' = [cstate EXCEPT ![<<r, c>>] =
                              IF pstate[r] = "unregistered" THEN "claimed" ELSE "granted"]
              /\ UNCHANGED told

Present(r, c) ==
    /\ cstate[<<r, c>>] = "waiting"
    /\ CASE gstate[r] = "open" ->
              \E full \in (IF MayBeFull THEN BOOLEAN ELSE {FALSE}) : PresentOpen(r, c, full)
         [] gstate[r] = "bound" ->
              /\ cstate' = [cstate EXCEPT ![<<r, c>>] =
                              IF bound[r] = c \/ BugSkipBinding
                              THEN IF pstate[r] = "unregistered" THEN "claimed" ELSE "granted"
                              ELSE "failed"]
              /\ UNCHANGED <<gstate, bound, told>>
         [] gstate[r] = "never" ->
              /\ cstate' = [cstate EXCEPT ![<<r, c>>] = "failed"]
              /\ told' = told \cup {<<r, c>>}
              /\ UNCHANGED <<gstate, bound>>
    /\ UNCHANGED <<written, aborted, pstate, untold>>

(* The consumer posts its READ once granted (D's claiming state: KVConsumer's
   ReadOnlyGranted), while the ledger holds the blocks: the gate grants no claim before
   the register (NoGrantBeforeRegister); a READ of blocks freed since is KVLifecycle's
   (stamps fence it). The bug reads without the grant. *)
Read(r, c) ==
    /\ cstate[<<r, c>>] = "granted" \/ (BugReadBeforeGrant /\ cstate[<<r, c>>] = "waiting")
    /\ pstate[r] = "held"
    /\ cstate' = [cstate EXCEPT ![<<r, c>>] = "reading"]
    /\ UNCHANGED <<written, aborted, gstate, bound, pstate, told, untold>>

(* The READ completed; its done comes from the bound consumer (present/same), or from
   another one (present/foreign: refused). A done that passes frees r (one expected
   reader), and the gate forgets r's binding (forget/freed). *)
Done(r, c) ==
    /\ cstate[<<r, c>>] = "reading"
    /\ cstate' = [cstate EXCEPT ![<<r, c>>] = "done"]
    /\ IF (bound[r] = c \/ BugSkipBinding) /\ pstate[r] = "held"
       THEN /\ pstate' = [pstate EXCEPT ![r] = "freed"]
            /\ gstate' = [gstate EXCEPT ![r] = "open"]
            /\ bound' = [bound EXCEPT ![r] = "none"]
       ELSE UNCHANGED <<pstate, gstate, bound>>
    /\ UNCHANGED <<written, aborted, told, untold>>

(* mirrors Gate.release and Gate.heartbeat: a consumer that gave up (refused, told, or
   failed on D) releases, or one that still waits heartbeats. From the bound consumer,
   or about a handle no consumer claimed, the message goes to the ledger: a release
   frees r (one expected reader; forget/freed), a heartbeat renews it (leases are
   KVLifecycle's: no change here). From another consumer it is refused
   (present/foreign), and so is a heartbeat about a never-registered handle
   (present/never) or a freed one (the ledger's refusal): a refused heartbeat fails that
   consumer (refused in its ack, D's ack/refused row). *)
Release(r, c) ==
    /\ cstate[<<r, c>>] \in {"waiting", "claimed", "granted", "failed"}
    /\ pstate[r] # "unregistered"  \* one before register is staged: KVLifecycle's business
    /\ cstate' = [cstate EXCEPT ![<<r, c>>] = "failed"]
    /\ IF (gstate[r] = "open" \/ bound[r] = c \/ BugSkipBinding) /\ pstate[r] = "held"
       THEN /\ pstate' = [pstate EXCEPT ![r] = "freed"]
            /\ gstate' = [gstate EXCEPT ![r] = IF @ = "bound" THEN "open" ELSE @]
            /\ bound' = [bound EXCEPT ![r] = "none"]
       ELSE UNCHANGED <<pstate, gstate, bound>>
    /\ UNCHANGED <<written, aborted, told, untold>>

Heartbeat(r, c) ==
    /\ cstate[<<r, c>>] \in {"waiting", "granted"}
    /\ \/ gstate[r] = "bound" /\ bound[r] # c /\ ~BugSkipBinding      \* present/foreign
       \/ gstate[r] = "never"                                         \* present/never
       \/ pstate[r] = "freed"                    \* the ledger refuses a freed request
    /\ cstate' = [cstate EXCEPT ![<<r, c>>] = "failed"]
    /\ UNCHANGED <<written, aborted, gstate, bound, pstate, told, untold>>

(* mirrors Gate.abandon: rows abandon/claimed (tell the bound consumer),
   abandon/unclaimed (tell every peer). A told consumer fails at once. Row abandon/again
   (refused, counted: nothing changes) is the stutter of an abandoned request: Abandon
   is not enabled twice (~aborted[r]). *)
Abandon(r) ==
    /\ ~aborted[r] /\ pstate[r] = "unregistered"
    /\ LET claimed == gstate[r] = "bound"
           to == IF claimed THEN {<<r, bound[r]>>}
                 ELSE IF BugNoNeverNotice THEN {} ELSE {r} \X Consumers
           owed == {p \in {r} \X Consumers :
                      cstate[p] \in (IF claimed THEN {"claimed", "granted"}
                                     ELSE {"waiting", "claimed", "granted"})}
       IN  /\ told' = told \cup to
           /\ untold' = untold \cup (owed \ to)
           /\ cstate' = [p \in Pairs |-> IF p \in to /\ cstate[p] \in {"waiting", "claimed",
                                                                    "granted"}
                                         THEN "failed" ELSE cstate[p]]
    /\ aborted' = [aborted EXCEPT ![r] = TRUE]
    /\ gstate' = [gstate EXCEPT ![r] = "never"]
    /\ bound' = [bound EXCEPT ![r] = "none"]
    /\ UNCHANGED <<written, pstate>>

Init ==
    /\ written = [r \in Requests |-> 0]
    /\ aborted = [r \in Requests |-> FALSE]
    /\ gstate = [r \in Requests |-> "open"]
    /\ bound = [r \in Requests |-> "none"]
    /\ pstate = [r \in Requests |-> "unregistered"]
    /\ cstate = [p \in Pairs |-> "waiting"]
    /\ told = {}
    /\ untold = {}

(* Nothing left to do (every request freed or abandoned): a safety model, so the end of
   a run is not a deadlock. *)
Quiet == UNCHANGED vars

Next ==
    \/ \E r \in Requests : Write(r) \/ GateRegister(r) \/ Abandon(r)
    \/ Quiet
    \/ \E r \in Requests, c \in Consumers : Present(r, c) \/ Read(r, c) \/ Done(r, c)
                                           \/ Release(r, c) \/ Heartbeat(r, c)

Spec == Init /\ [][Next]_vars

ConsumerSymmetry == Permutations(Consumers \ Forgers)

GateTypeOK ==
    /\ written \in [Requests -> 0..Chunks]
    /\ aborted \in [Requests -> BOOLEAN]
    /\ gstate \in [Requests -> {"open", "bound", "never"}]
    /\ bound \in [Requests -> Consumers \cup {"none"}]
    /\ pstate \in [Requests -> {"unregistered", "held", "freed"}]
    /\ cstate \in [Pairs -> {"waiting", "claimed", "granted", "reading", "done", "failed"}]
    /\ \A r \in Requests : (gstate[r] = "bound") = (bound[r] # "none")

(* Per claimant: every consumer whose READ is in flight reads blocks the ledger holds. *)
NoFreeUnderRead == \A p \in Pairs : cstate[p] = "reading" => pstate[p[1]] = "held"

(* No consumer is granted a handle the ledger has not registered: a claim that binds
   it earlier is answered at its register. *)
NoGrantBeforeRegister ==
    \A p \in Pairs : cstate[p] = "granted" => pstate[p[1]] # "unregistered"

(* The ledger holds only requests whose every chunk was written. *)
ReadinessHolds == \A r \in Requests : pstate[r] # "unregistered" => written[r] = Chunks

(* An abandoned request's bound consumer (or, when none was bound, every holder of its
   params) is told in the step that abandons it. *)
NeverToldAtOnce == untold = {}

(* Only a consumer that got the params (the right capability) binds a handle or is
   served: a forger binds nothing, reads nothing. *)
OnlyHoldersBind ==
    /\ \A r \in Requests : bound[r] \notin Forgers
    /\ \A r \in Requests, c \in Forgers : cstate[<<r, c>>] \notin {"granted", "reading", "done"}

(* Only one consumer of a request is ever served from P's blocks. *)
OneConsumerServed ==
    \A r \in Requests : Cardinality({c \in Consumers : cstate[<<r, c>>] \in {"reading", "done"}}) <= 1
=============================================================================
