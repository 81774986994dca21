"""Lock backends, one module each; locks/registry.py maps URL schemes to them."""
