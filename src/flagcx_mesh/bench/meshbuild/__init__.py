"""Benchmarks of building a mesh: `bench mesh` (vs gloo's init), `bench race` (FlagCX's full-mesh loop vs
the fixed builders) and `bench soak` (builds under jitter, foreign traffic and killed ranks)."""
