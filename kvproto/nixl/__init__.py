"""NIXL adapters: real transfers for the kvproto lifecycle (P producer, D consumer)."""
