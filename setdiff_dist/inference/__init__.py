"""The inference path: weights from any layout, the KV cache, and the set decoder."""
