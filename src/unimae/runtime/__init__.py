"""How unimae runs on the machine: OpenMP threads, heap memory, device and precision."""
