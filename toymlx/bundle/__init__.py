"""What a run bundle holds on disk: its options and config.json, events.jsonl, checkpoints, and the checks on what a run reads and writes."""
