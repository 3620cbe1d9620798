"""The parallel layouts and engines as records, read by both sides (no torch)."""
