"""The executor layer: what runs the model on one rank or on many (below the engine, above the
model, the attention backends and the KV managers)."""
