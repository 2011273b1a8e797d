"""Phase 5: file formats and their parity check, export from a training checkpoint, publishing and the registry."""
