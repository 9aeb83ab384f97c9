"""Data: shard layout and manifests (shared with data_tools), the streaming loader, transforms."""
