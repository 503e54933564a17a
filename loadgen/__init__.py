"""tandem bench: a load generator and report for any OpenAI-compatible endpoint."""
