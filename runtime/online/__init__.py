"""Online serving: an OpenAI-compatible HTTP server (parent process) over engine workers (one per rank)."""
