"""Tests of the worker package: the app, start-up checks, beat election, the CLI."""
