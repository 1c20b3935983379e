"""Small hand-written attention implementations, each with one planted fault (see diagnose)."""
