"""Test machinery: the simulated transport, the simulator, the stateful fuzzer and the
mutants. Nothing on the production path imports this package."""
