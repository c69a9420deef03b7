def join_prefix(prefix: str, name: str) -> str:
    """Dotted module path of a child: join_prefix("model", "layers.0") == "model.layers.0"."""
    return f"{prefix}.{name}" if prefix else name
