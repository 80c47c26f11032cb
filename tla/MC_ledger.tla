---------------------------- MODULE MC_ledger ----------------------------
(* The ledger alone, driven by any input: the TLC side of the Python-vs-TLC
   state-graph equality check. 2 requests in one sibling group sharing a block,
   2 readers, expected readers announced in 0..2. *)
EXTENDS KVLedger
MCBlocksOf == [r \in Requests |-> IF r = "r1" THEN {1, 2} ELSE {1, 3}]
MCGroupOf == [r \in Requests |-> "g1"]
MCRegExpected == [r \in Requests |-> 0]
=============================================================================
