"""Tests of the task layer: keys, executor, effects and @singleton_task without workers."""
