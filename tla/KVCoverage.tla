----------------------------- MODULE KVCoverage -----------------------------
(***************************************************************************)
(* One D rank's coverage machine: kvproto.lifecycle.coverage.Coverage,    *)
(* rows C_TRANSITIONS, name for name. A request's KV on a D rank comes    *)
(* from the P ranks of its region map (parts); each part is read by its   *)
(* own Consumer entry (KVConsumer). A region is <<P rank, layer, group>>. *)
(*                                                                         *)
(* Expect(r): the region map arrives (rows EXPECT/regions,                *)
(* nothing_needed). PartRead(r, p, S): part p's READ landed with its      *)
(* stamps matched, and transferred the regions S (any subset of the       *)
(* part's regions: a READ plan may drop one); rows PART_READ/short,       *)
(* more_parts, all_read (duplicate and unknown parts change nothing).     *)
(* PartFailed(r, p): the part ended any other way (PART_FAILED/failed).   *)
(*                                                                         *)
(* BugDropRegion: the guard of PartRead ignores one region of the part    *)
(* (the mutant drop_region): a READ that missed that region still counts  *)
(* as the part read. TLC then finds a request reported complete with a    *)
(* region never read (Coverage).                                          *)
(*                                                                         *)
(* BugOnePart: a part read and verified completes the request while other *)
(* parts are pending (the mutant one_part): a split request served after  *)
(* one P rank's READ. TLC finds Coverage violated.                        *)
(*                                                                         *)
(* ABSTRACTION (Python -> TLA+): cst[r] = Coverage.state(r); got[r] =     *)
(* Coverage.read(r) while covering, what its CoverageDone named after;    *)
(* left[r] = Coverage.pending(r); ceff = the effects of the last step.    *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS Requests, Parts, Layers, Groups, NeedOf, BugDropRegion, BugOnePart

VARIABLES cst, got, left, ceff
cvars == <<cst, got, left, ceff>>

RegionsOf(p) == {<<p, l, g>> : l \in Layers, g \in Groups}
Needed(r) == UNION {RegionsOf(p) : p \in NeedOf[r]}
CStates == {"new", "covering", "complete", "incomplete"}
Ended == {"complete", "incomplete"}

(* The region the mutant's guard forgets: one fixed region of each part. *)
Dropped(p) == CHOOSE x \in RegionsOf(p) : TRUE
PartCovered(p, S) == IF BugDropRegion THEN RegionsOf(p) \ {Dropped(p)} \subseteq S
                     ELSE RegionsOf(p) \subseteq S

Done(r, ok, why) == [k |-> "done", r |-> r, ok |-> ok, why |-> why]
Cancel(r) == [k |-> "cancel", r |-> r, ok |-> FALSE, why |-> ""]

CInit == /\ cst = [r \in Requests |-> "new"]
         /\ got = [r \in Requests |-> {}]
         /\ left = [r \in Requests |-> {}]
         /\ ceff = {}

(* event expect: rows EXPECT/regions, nothing_needed (the cap, EXPECT/full, is not
   reached in the model) *)
Expect(r) ==
    /\ cst[r] = "new"
    /\ IF Needed(r) = {}
       THEN /\ cst' = [cst EXCEPT ![r] = "incomplete"]
            /\ ceff' = {Done(r, FALSE, "no_regions")}
            /\ UNCHANGED <<got, left>>
       ELSE /\ cst' = [cst EXCEPT ![r] = "covering"]
            /\ left' = [left EXCEPT ![r] = NeedOf[r]]
            /\ ceff' = {}
            /\ UNCHANGED got

(* event part_read: rows PART_READ/short (cancel the other parts), more_parts (record),
   all_read (record, finish:complete); S: the regions the part's READ transferred and
   verified *)
PartRead(r, p, S) ==
    /\ cst[r] = "covering" /\ p \in left[r] /\ S \subseteq RegionsOf(p)
    /\ LET rest == left[r] \ {p}
           read == got[r] \cup S
       IN  IF ~PartCovered(p, S)
           THEN /\ cst' = [cst EXCEPT ![r] = "incomplete"]
                /\ left' = [left EXCEPT ![r] = {}]
                /\ ceff' = {Done(r, FALSE, "short")} \cup (IF rest # {} THEN {Cancel(r)} ELSE {})
                /\ UNCHANGED got
           ELSE /\ got' = [got EXCEPT ![r] = read]
                /\ left' = [left EXCEPT ![r] = IF BugOnePart THEN {} ELSE rest]
                /\ cst' = [cst EXCEPT ![r] = IF rest = {} \/ BugOnePart THEN "complete"
                                                                  ELSE "covering"]
                /\ ceff' = IF rest = {} \/ BugOnePart THEN {Done(r, TRUE, "complete")} ELSE {}

(* event part_failed: row PART_FAILED/failed *)
PartFailed(r, p) ==
    /\ cst[r] = "covering" /\ p \in left[r]
    /\ LET rest == left[r] \ {p} IN
       /\ cst' = [cst EXCEPT ![r] = "incomplete"]
       /\ left' = [left EXCEPT ![r] = {}]
       /\ ceff' = {Done(r, FALSE, "part_failed")} \cup (IF rest # {} THEN {Cancel(r)} ELSE {})
       /\ UNCHANGED got

(* Every request ended: the model's end (a stutter, not a deadlock). *)
CEnd == (\A r \in Requests : cst[r] \in Ended) /\ UNCHANGED cvars

CNext == \/ \E r \in Requests :
             \/ Expect(r)
             \/ \E p \in Parts : \/ PartFailed(r, p)
                                 \/ \E S \in SUBSET RegionsOf(p) : PartRead(r, p, S)
         \/ CEnd

CoverageTypeOK ==
    /\ cst \in [Requests -> CStates]
    /\ \A r \in Requests : got[r] \subseteq Needed(r) /\ left[r] \subseteq NeedOf[r]

(* Coverage: no request is reported complete unless every region of its map was read
   and verified. *)
Coverage == \A r \in Requests : cst[r] = "complete" => Needed(r) \subseteq got[r]

(* A complete report names no missing region, and an ended request stays ended. *)
CompleteReportsAll == \A e \in ceff : e.k = "done" /\ e.ok => Needed(e.r) \subseteq got[e.r]
EndedStays == [][\A r \in Requests : cst[r] \in Ended => cst'[r] = cst[r]]_cvars
=============================================================================
