---------------------------- MODULE MC_coverage ----------------------------
(* Model values for MC_coverage.cfg, MC_bug_drop_region.cfg and MC_bug_one_part.cfg: P TP 2 -> D TP 1 (r1
   needs both P ranks), and the replicated case where D reads one P rank only (r2: P
   rank 1 is an orphan); 2 layers, 1 KV cache group. *)
EXTENDS KVCoverage
MCNeedOf == [r \in Requests |-> IF r = "r1" THEN {0, 1} ELSE {0}]
=============================================================================
