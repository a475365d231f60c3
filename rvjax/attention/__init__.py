"""Attention implementations behind one interface. `xla` is the reference, correct on every backend."""
