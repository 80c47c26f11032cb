"""kvproto: KV-block lifecycle protocol for P/D disaggregated serving."""
