------------------------------ MODULE MC_gate ------------------------------
(* Model values for the KVGate configs (MC_gate*.cfg). *)
EXTENDS KVGate, TLC
=============================================================================
