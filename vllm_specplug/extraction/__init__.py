"""Hidden-state extraction: a KV connector, a sharded safetensors dataset, a reader."""
