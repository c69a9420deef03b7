"""`skill bench`: the runtime against transformers `generate` on the same model, dtype and threads."""
