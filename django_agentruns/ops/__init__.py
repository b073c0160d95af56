"""Operators' reads: what the engine is doing and why, for the admin and the commands."""
