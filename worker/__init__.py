"""The Celery side of jobfence: the app (one composition root), signals, beat election, the CLI."""
