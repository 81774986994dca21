"""Issue 18's model-based test: random sequences across option combinations on a real worker."""
