"""Arithmetic: pure functions over specs (bytes, FLOPs, roofline times, KV pools)."""
