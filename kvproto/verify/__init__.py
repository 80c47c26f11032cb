"""Verification: TLC runner, model registry, oracle, conformance and trace validation."""
