"""Benchmarks of the mesh's one-sided data path: `bench put` (host and `--device cuda` windows vs memcpy,
raw sockets and a local D2D copy), `bench put-mpi` (vs MPI_Put), `bench latency` and `bench stream-wait`
(from C; their programs `latency.c` and `stream_wait.c` ship here)."""
