"""ModelPerfBackend and the perf-mode config readers (their issue adds the contents)."""
