"""Benchmarks, grouped by what they measure: `build` (making a mesh), `onesided` (the mesh's data
path), `agents` (agents and the P2P engine form) and `kv` (the vLLM connector's transfer part). The
pieces they share (`_ranks`: launching ranks and saving JSON, `_sizes`, `_plot`, `_gpumem`) sit here;
`python -m flagcx_mesh.bench --help` lists the commands."""
