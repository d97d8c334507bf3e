"""Operational endpoints: liveness, readiness, metrics, capabilities."""
