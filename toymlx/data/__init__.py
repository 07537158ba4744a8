"""Data loading: text, chat/JSONL and images, as numpy batches pure in (seed, step)."""
