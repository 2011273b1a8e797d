"""The process's life: environment, threads, child processes, imports, telemetry, signals, spot watcher, slots."""
