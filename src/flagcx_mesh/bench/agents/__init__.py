"""Benchmarks of agents: `bench agent` (host and `--device cuda` memory, vs memcpy, the mesh's puts,
Mooncake TE and NIXL) and `bench p2p` (the P2P engine form vs the agent's batch). The modules with a
leading underscore are its private pieces: the peers' wrappers, the mesh beside it, and the GPU
target program (`_gpu_target`, started as `bench agent-gpu-target`) with its driver (`_gpu_child`)."""
