------------------------------- MODULE MC -------------------------------
(* Model values for the KVLifecycle configs (MC_*.cfg). Two requests r1, r2 in one
   sibling group g1 sharing block 1, each pulled by every reader of the config (with d1
   and d2: fan-in 2); r1's expected readers are announced by D, r2's known at register. *)
EXTENDS KVLifecycle
MCBlocksOf == [r \in Requests |-> IF r = "r1" THEN {1, 2} ELSE {1, 3}]
MCGroupOf == [r \in Requests |-> "g1"]
MCRegExpected == [r \in Requests |-> IF r = "r1" THEN 0 ELSE Cardinality(Readers)]
MCReadersOf == [r \in Requests |-> Readers]
=============================================================================
