"""Phase 5's judging half: perplexity, generations for review, the run's note (release/ ships and gates)."""
