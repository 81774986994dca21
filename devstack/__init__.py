"""Test and benchmark tooling (server launchers, peer benches): in the repository, not the wheel."""
