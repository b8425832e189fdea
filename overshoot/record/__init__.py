"""Stage 1, on the engine thread: the Recorder (busy/wait/idle spans, step facts), its CUDA events, NVTX
ranges, the spool writer and the process lifecycle (flush at exit and on signals). No pandas here."""
